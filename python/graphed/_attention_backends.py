"""Which of torch's attention kernels the serving decoder lets SDPA pick.

Note [Served attention without cuDNN's plans]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On Hopper, torch 2.11 sends bf16 and fp16 ``scaled_dot_product_attention`` to
cuDNN first, and cuDNN builds an execution plan for every new shape: about
17 ms of host time per new sequence length and layer shape (measured on an
H100, Qwen3-MoE 4 layers d512 bf16: a 101-token prefill took 82 ms the first
time and 10 ms the second; the profile put 68 ms in
``aten::_cudnn_attention_forward``). A serving decoder prefills every request
eagerly at its own prompt length, so on a first pass nearly every prefill is
a new shape, and the plans, not the model, set the speed (3269 tokens/s on
the first pass against 13237 once the lengths had been seen). Inside a graph
the plan is built once at capture and costs nothing after; eagerly, flash and
memory-efficient attention have no plan to build.

So the serving decoder runs its prefills and captures its decode steps with
cuDNN attention switched off, where flash or memory-efficient attention is
on to take its place (otherwise only the math kernel would be left, which is
slower than any plan). Its attention is then the same kernel in the prefill
and in the step, and a reference that wants its tokens runs transformers
under the same switch (``tests/python/test_generate_batch.py``). The switch
is torch's global flag (``torch.backends.cuda.enable_cudnn_sdp``), restored
on the way out; another thread running SDPA at that moment picks among the
same kernels, which changes its speed, never its correctness. float32 never
reaches cuDNN attention, so the switch changes nothing there, and no note is
written. ``graphed.generate`` is left as it is: its prefills are captured
once per prompt length, so each length pays the plan once, as a capture does.
"""

from __future__ import annotations

import contextlib

import torch

HALF_PRECISION = (torch.float16, torch.bfloat16)


def can_avoid_cudnn_attention() -> bool:
    """Whether cuDNN attention is on and flash or memory-efficient attention
    could take its place."""
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled() and (cuda.flash_sdp_enabled()
                                         or cuda.mem_efficient_sdp_enabled())


@contextlib.contextmanager
def attention_without_cudnn():
    """SDPA without cuDNN attention inside the block, where another fused
    kernel can take its place (Note [Served attention without cuDNN's plans]);
    otherwise nothing changes. Yields whether the switch was made."""
    if not can_avoid_cudnn_attention():
        yield False
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def served_attention_note(model) -> list:
    """The note a serving decoder adds when the switch matters for ``model``:
    half-precision weights, SDPA attention, on the GPU, cuDNN attention on."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if (getattr(model, "dtype", None) not in HALF_PRECISION or implementation != "sdpa"
            or model.device.type != "cuda" or not can_avoid_cudnn_attention()):
        return []
    return [f"attention runs on SDPA's flash or memory-efficient kernels, not cuDNN's, in "
            f"prefills and decode steps ({str(model.dtype).replace('torch.', '')} weights): "
            f"cuDNN builds a plan per new prompt length, about 17 ms each on an H100, which "
            f"a first pass over new lengths would pay per request (Note [Served attention "
            f"without cuDNN's plans])"]
