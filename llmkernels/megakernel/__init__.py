"""A decode step as one persistent kernel: its instruction schedule, built on the host (schedule.py)."""
from .schedule import Program, build_decode_program, check, describe, simulate

__all__ = ["Program", "build_decode_program", "check", "describe", "simulate"]
