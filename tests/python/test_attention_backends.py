"""The serving decoder's attention switch (Note [Served attention without
cuDNN's plans]): torch's global flags, set and restored; CPU tests."""

import pytest
import torch

from graphed._attention_backends import (attention_without_cudnn, can_avoid_cudnn_attention,
                                         served_attention_note)


@pytest.fixture
def sdp_flags():
    cuda = torch.backends.cuda
    saved = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
             cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled())
    yield cuda
    cuda.enable_flash_sdp(saved[0])
    cuda.enable_mem_efficient_sdp(saved[1])
    cuda.enable_cudnn_sdp(saved[2])
    cuda.enable_math_sdp(saved[3])


def test_cudnn_attention_is_off_inside_and_back_on_after(sdp_flags):
    sdp_flags.enable_cudnn_sdp(True)
    with attention_without_cudnn() as switched:
        assert switched and not sdp_flags.cudnn_sdp_enabled()
        assert sdp_flags.flash_sdp_enabled() and sdp_flags.math_sdp_enabled()
    assert sdp_flags.cudnn_sdp_enabled()


def test_the_flag_comes_back_when_the_block_raises(sdp_flags):
    sdp_flags.enable_cudnn_sdp(True)
    with pytest.raises(RuntimeError, match="inside"):
        with attention_without_cudnn():
            raise RuntimeError("inside")
    assert sdp_flags.cudnn_sdp_enabled()


def test_nothing_changes_without_a_fused_kernel_to_take_cudnns_place(sdp_flags):
    sdp_flags.enable_cudnn_sdp(True)
    sdp_flags.enable_flash_sdp(False)
    sdp_flags.enable_mem_efficient_sdp(False)
    assert not can_avoid_cudnn_attention()
    with attention_without_cudnn() as switched:
        assert not switched and sdp_flags.cudnn_sdp_enabled()
    assert sdp_flags.cudnn_sdp_enabled()


def test_a_user_who_turned_cudnn_off_keeps_it_off(sdp_flags):
    sdp_flags.enable_cudnn_sdp(False)
    with attention_without_cudnn() as switched:
        assert not switched
    assert not sdp_flags.cudnn_sdp_enabled()


class _Config:
    _attn_implementation = "sdpa"


class _Model(torch.nn.Module):
    def __init__(self, dtype, device="cuda"):
        super().__init__()
        self.config = _Config()
        self.dtype, self.device = dtype, torch.device(device)


def test_the_note_is_written_only_where_cudnn_attention_could_run(sdp_flags):
    sdp_flags.enable_cudnn_sdp(True)
    note = served_attention_note(_Model(torch.bfloat16))
    assert len(note) == 1 and "bfloat16" in note[0] and "cuDNN" in note[0]
    assert served_attention_note(_Model(torch.float32)) == []
    assert served_attention_note(_Model(torch.float16, device="cpu")) == []
    eager = _Model(torch.bfloat16)
    eager.config._attn_implementation = "eager"
    assert served_attention_note(eager) == []
