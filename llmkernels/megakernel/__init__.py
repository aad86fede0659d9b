"""A decode step as one persistent kernel: its instruction schedule, built on the host (schedule.py), a Triton
reference executor (kernel.py), the weight stacks (weights.py), the Gluon sm_90 executor (fast.py, q4k.py) and
its place in the engine (engine.py)."""
from .schedule import Program, build_decode_program, check, describe, simulate

__all__ = ["Program", "build_decode_program", "check", "describe", "simulate"]
