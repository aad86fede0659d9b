"""The processes of a tensor-parallel engine: rank 0 (the caller) starts the others and drives them (``Peers``);
each other rank runs ``worker_main``, builds its shard (build.py) and runs the steps rank 0 sends."""
from __future__ import annotations

import datetime
import os
import time

import torch

from .build import build_worker
from .config import ModelConfig
from .tp import plan_shards

TIMEOUT_S = float(os.environ.get("LLMKERNELS_TP_TIMEOUT", 600))  # a rank that stops answering fails the others
# NVLink multicast stays off in every process of the group (it can take shared GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_group(rank: int, world: int, init_method: str, backend: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; a tensor-parallel LLM "
                           "starts its own (close the other with LLM.close())")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peers:
    """Rank 0's handle on the other ranks: their processes, a pipe to each for commands (so an idle engine waits
    without a collective timing out) and the collectives of a step."""

    def __init__(self, procs, conns):
        self.procs, self.conns = procs, conns
        self.own_group = False  # whether this handle created the process group (and so destroys it)

    @classmethod
    def start(cls, path: str, world: int, device: torch.device, spec: dict) -> "Peers":
        """Start ranks 1 .. world-1 (each loads its shard of ``path``) and join them in a process group."""
        import torch.multiprocessing as mp

        os.environ.update(SAFE_ENV)
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, world, init_method, backend, path, spec, device.type,
                                                      theirs), daemon=True, name=f"llmkernels-tp{rank}")
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
        peers = cls(procs, conns)
        try:
            for rank, conn in enumerate(conns, 1):
                peers._expect(rank, conn, "ready", TIMEOUT_S)
            if device.type == "cuda":
                torch.cuda.set_device(device.index or 0)
            init_group(0, world, init_method, backend)
            peers.own_group = True
        except BaseException:
            peers.stop()
            raise
        return peers

    def _expect(self, rank: int, conn, what: str, timeout: float) -> None:
        proc = self.procs[rank - 1]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} did not start within {timeout:.0f} s")
        msg = conn.recv()
        if msg[0] != what:
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {msg[1] if len(msg) > 1 else msg}")

    def _check(self) -> None:
        """Raise if another rank reported an error or is gone."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), 1):
            msg = None
            try:
                if conn.poll():
                    msg = conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed: the process is gone
                p.join(timeout=5)
            if msg is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {msg[1] if len(msg) > 1 else msg}")
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.exitcode}; the engine stops "
                                   f"(close it and start a new one)")

    def send(self, cmd) -> None:
        """Have every other rank run ``cmd`` (``("run", step, has_ids)``, ``("copy", pairs)``, ...)."""
        self._check()
        try:
            for conn in self.conns:
                conn.send(cmd)
        except (BrokenPipeError, EOFError, OSError):
            self._check()
            raise

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=0)

    def stop(self) -> None:
        """Tell the other ranks to stop, leave the process group as they leave theirs, and wait for them (killing
        any that hang)."""
        import torch.distributed as dist

        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, EOFError, OSError):
                pass
        if self.own_group and dist.is_initialized():
            _leave_group(min(TIMEOUT_S, 60.0))
        self.own_group = False
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def _end_group() -> None:
    """Leave the process group (the captured graphs released first: see ModelRunner.release_graphs). NCCL groups
    are aborted, which does not wait on the other ranks: at close nothing in flight is needed."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend() == "nccl":
        abort()
    else:
        dist.destroy_process_group()


def _leave_group(timeout: float) -> None:
    """``_end_group``, given up (with a warning) after ``timeout`` seconds rather than hanging the caller."""
    import threading
    import warnings

    t = threading.Thread(target=_end_group, daemon=True, name="llmkernels-tp-teardown")
    t.start()
    t.join(timeout)
    if t.is_alive():
        warnings.warn(f"tensor parallelism: leaving the process group did not finish within {timeout:.0f} s; "
                      f"the engine is closed, but this process cannot start another tensor-parallel engine",
                      RuntimeWarning, stacklevel=3)


def plan_shards_from_path(path: str, world: int) -> list:
    from ..quant.gguf_io import read_gguf

    f = read_gguf(path)
    return plan_shards(ModelConfig.from_gguf(f.metadata, f.keys()), world, f)


def worker_main(rank: int, world: int, init_method: str, backend: str, path: str, spec: dict, device: str,
                conn) -> None:
    """A rank other than 0: build its shard of the model and cache, then run the steps rank 0 sends."""
    os.environ.update(SAFE_ENV)
    import torch.distributed as dist

    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        conn.send(("ready",))
        init_group(rank, world, init_method, backend)
        shard = plan_shards_from_path(path, world)[rank]
        runner = build_worker(path, shard, device, spec)
        runner.serve_steps(conn)
    except BaseException as e:  # noqa: BLE001  (report to rank 0, then exit non-zero)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (BrokenPipeError, EOFError, OSError):
            pass
        raise SystemExit(1) from e
    finally:
        if dist.is_initialized():
            _end_group()
