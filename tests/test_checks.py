"""Boundary checks: messages name the argument, what it got and what was expected."""
import pytest
import torch

from llmkernels._checks import check_choice, check_cu_seqlens, check_positive_int, check_tensor


def test_check_tensor_messages():
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        check_tensor("x", [1])
    with pytest.raises(TypeError, match=r"x must have dtype in \(float16\), got float32"):
        check_tensor("x", torch.zeros(2), dtypes=(torch.float16,))
    with pytest.raises(ValueError, match=r"x must have shape \(2, '\*'\) .*got \(3, 4\)"):
        check_tensor("x", torch.zeros(3, 4), shape=(2, None))
    with pytest.raises(ValueError, match="contiguous last dim"):
        check_tensor("x", torch.zeros(4, 4).t(), last_dim_contiguous=True)


def test_cu_seqlens_and_scalars():
    check_cu_seqlens("cu", torch.tensor([0, 3, 3, 9], dtype=torch.int32), batch=3, total=9)
    with pytest.raises(ValueError, match="cu\\[0\\] must be 0"):
        check_cu_seqlens("cu", torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be >= 1"):
        check_positive_int("page_size", 0)
    with pytest.raises(TypeError, match="must be an int"):
        check_positive_int("page_size", 1.5)
    with pytest.raises(ValueError, match="must be one of"):
        check_choice("fmt", "x", ["a"])


def test_cu_seqlens_checked_again_after_in_place_writes(monkeypatch):
    import llmkernels._checks as checks

    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    check_cu_seqlens("cu", cu, total=9)
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k))
    check_cu_seqlens("cu", cu, total=9)  # unchanged since its check: no copy to the host
    assert copies == []
    with pytest.raises(ValueError, match="must equal the number of tokens 10"):
        check_cu_seqlens("cu", cu, total=10)  # another total is checked again
    cu[1] = 12  # an in-place write bumps the version counter: the values are checked again
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens("cu", cu, total=9)
    with torch.inference_mode():  # inference tensors have no version counter: checked every time
        cu2 = torch.tensor([0, 5, 2], dtype=torch.int32)
        for _ in range(2):
            with pytest.raises(ValueError, match="non-decreasing"):
                check_cu_seqlens("cu", cu2)
    assert len(copies) == 4
    assert checks._VALIDATED


def test_max_seqlen_smaller_than_a_sequence_is_refused():
    """A max_seqlen below the longest sequence would leave output rows unwritten: refused, naming both."""
    import llmkernels as lk

    from .attention.paged_helpers import build

    q, k, v = (torch.randn(30, 2, 64, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q is 19 but cu_seqlens_q holds a sequence of 20"):
        lk.flash_attn_varlen(q, k, v, cu, cu, 19, 20)
    with pytest.raises(ValueError, match="max_seqlen_k is 5 but cu_seqlens_k"):
        lk.flash_attn_varlen(q, k, v, cu, cu, 20, 5)
    qp, kc, vc, pt, sl, cuq = build([1, 4], [9, 12], 4, 2, 2, 64)
    with pytest.raises(ValueError, match="max_seqlen_q is 3 but cu_seqlens_q holds a sequence of 4 queries"):
        lk.paged_attention(qp, kc, vc, pt, sl, cuq, 3)
    with pytest.raises(TypeError, match="max_seqlen_q must be a non-negative int"):
        lk.paged_attention(qp, kc, vc, pt, sl, cuq, 4.0)


def test_one_cu_seqlens_for_q_and_k_is_copied_once(monkeypatch):
    """The usual self-attention call passes one tensor as both cu_seqlens: its checks are remembered for both roles,
    so repeated calls make no host copy (a copy is a sync, which would cost more than a short prefill)."""
    import llmkernels as lk

    q, k, v = (torch.randn(12, 2, 32, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k))
    lk.flash_attn_varlen(q, k, v, cu, cu, 7, 8, causal=True)  # max_seqlen_k differs: checked in both roles
    assert len(copies) == 2
    for _ in range(3):
        lk.flash_attn_varlen(q, k, v, cu, cu, 7, 8, causal=True)
    assert len(copies) == 2


def test_device_facts_cached_per_index_once_cuda_is_initialized(monkeypatch):
    """num_sms / gpu_name read torch once per device index after CUDA is initialized (a kernel launch asks each time),
    never for the current device (no index) and not before initialization (a test's stand-in GPU is not
    remembered); CPU devices get the interpreter's values."""
    import torch

    from llmkernels import _runtime

    monkeypatch.setattr(_runtime, "_FACTS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reads = []

    def read(d):
        reads.append(d)
        return f"gpu{len(reads)}"

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert _runtime._device_fact("name", None, read, "cpu") == "gpu1"
    assert _runtime._device_fact("name", None, read, "cpu") == "gpu2"  # not initialized: read again
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert _runtime._device_fact("name", 1, read, "cpu") == "gpu3"
    assert _runtime._device_fact("name", torch.device("cuda", 1), read, "cpu") == "gpu3"  # cached under index 1
    assert _runtime._device_fact("name", torch.device("cuda"), read, "cpu") == "gpu4"
    assert _runtime._device_fact("name", torch.device("cuda"), read, "cpu") == "gpu5"  # current device: no cache
    assert _runtime._device_fact("name", torch.device("cpu"), read, "cpu") == "cpu"
    assert reads == [0, 0, 1, torch.device("cuda"), torch.device("cuda")]
