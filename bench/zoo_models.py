"""The model zoo: unmodified models from transformers, timm and torchvision,
random init from configs (nothing downloaded), with the batches and losses
their users train them with. bench/zoo.py times them; the GPU tests in
tests/python/test_zoo_gpu.py check numerics on smaller sizes of the same.

Each entry builds a ``ZooModel``: the model on the GPU in training mode, an
optimizer factory, the loss (``None``: the model's own, from ``labels`` in a
dict batch, as Hugging Face users train), a training batch, and inference
inputs for a batch size. Sizes: "bench" is the size of the results tables,
"test" a smaller one for the test tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

SIZES = ("bench", "test")


@dataclass
class ZooModel:
    name: str
    library: str
    model: nn.Module
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    loss_fn: Optional[Callable[..., torch.Tensor]]
    batch: Any
    #: Inference inputs of ``batch_size`` rows: (args, kwargs).
    inference_inputs: Callable[[int], Tuple[tuple, dict]]
    description: str
    is_transformer: bool
    notes: Dict[str, Any] = field(default_factory=dict)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _tokens(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), device="cuda", generator=generator)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def gpt2(size: str) -> ZooModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, batch, length = (6, 384, 6, 8, 128) if size == "bench" else (2, 64, 4,
                                                                                       4, 32)
    vocab = 8192 if size == "bench" else 512
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                        n_positions=max(length, 128), bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).cuda().train()
    g = _generator()
    ids = _tokens(g, batch, length, vocab)
    return ZooModel(
        "hf_gpt2", "transformers", model, _adamw, None, {"input_ids": ids, "labels": ids},
        lambda b: ((), {"input_ids": _tokens(_generator(b), b, length, vocab),
                        "use_cache": False}),
        f"GPT-2 {layers} layers d{width}, {batch}x{length} tokens, default config (use_cache on)",
        True)


def llama(size: str) -> ZooModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, width, heads, kv, batch, length = ((4, 512, 8, 2, 4, 128) if size == "bench"
                                               else (2, 64, 4, 2, 2, 32))
    vocab = 8192 if size == "bench" else 512
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=int(width * 2.6875),
                         vocab_size=vocab, max_position_embeddings=max(length, 128),
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).cuda().train()
    ids = _tokens(_generator(), batch, length, vocab)
    return ZooModel(
        "hf_llama", "transformers", model, _adamw, None, {"input_ids": ids, "labels": ids},
        lambda b: ((), {"input_ids": _tokens(_generator(b), b, length, vocab),
                        "use_cache": False}),
        f"Llama {layers} layers d{width}, GQA {heads}/{kv} heads, {batch}x{length} tokens", True)


def _padded_mask(generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    lengths = torch.randint(length // 4, length + 1, (batch,), device="cuda", generator=generator)
    positions = torch.arange(length, device="cuda")
    return (positions[None, :] < lengths[:, None]).long()


def bert(size: str) -> ZooModel:
    from transformers import BertConfig, BertForSequenceClassification

    layers, width, heads, batch, length = ((4, 256, 4, 16, 128) if size == "bench"
                                           else (2, 64, 4, 4, 32))
    vocab = 8192 if size == "bench" else 512
    config = BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                        intermediate_size=4 * width, vocab_size=vocab, num_labels=3,
                        max_position_embeddings=max(length, 128))
    model = BertForSequenceClassification(config).cuda().train()
    g = _generator()
    ids = _tokens(g, batch, length, vocab)
    mask = _padded_mask(g, batch, length)
    labels = torch.randint(0, 3, (batch,), device="cuda", generator=g)

    def inputs(b: int) -> Tuple[tuple, dict]:
        gi = _generator(b)
        return (), {"input_ids": _tokens(gi, b, length, vocab),
                    "attention_mask": _padded_mask(gi, b, length)}

    return ZooModel(
        "hf_bert", "transformers", model, _adamw, None,
        {"input_ids": ids, "attention_mask": mask, "labels": labels}, inputs,
        f"BERT classifier {layers} layers d{width}, padded attention mask, {batch}x{length}", True)


def t5(size: str) -> ZooModel:
    from transformers import T5Config, T5ForConditionalGeneration

    layers, width, heads, batch, source, target = ((4, 256, 4, 8, 128, 32) if size == "bench"
                                                   else (2, 64, 4, 2, 32, 8))
    vocab = 8192 if size == "bench" else 512
    config = T5Config(num_layers=layers, num_decoder_layers=layers, d_model=width,
                      d_ff=4 * width, num_heads=heads, d_kv=width // heads, vocab_size=vocab,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(config).cuda().train()
    g = _generator()
    ids = _tokens(g, batch, source, vocab)
    labels = _tokens(g, batch, target, vocab)

    def inputs(b: int) -> Tuple[tuple, dict]:
        gi = _generator(b)
        return (), {"input_ids": _tokens(gi, b, source, vocab),
                    "decoder_input_ids": _tokens(gi, b, target, vocab), "use_cache": False}

    return ZooModel(
        "hf_t5", "transformers", model, _adamw, None, {"input_ids": ids, "labels": labels},
        inputs, f"T5 encoder-decoder {layers}+{layers} layers d{width}, {batch}x{source} -> "
                f"{target} tokens", True)


def _images(generator: torch.Generator, batch: int, side: int) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, device="cuda", generator=generator)


def _classes(generator: torch.Generator, batch: int, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, (batch,), device="cuda", generator=generator)


def hf_vit(size: str) -> ZooModel:
    from transformers import ViTConfig, ViTForImageClassification

    layers, width, heads, batch, side = ((6, 384, 6, 16, 224) if size == "bench"
                                         else (2, 64, 4, 4, 32))
    config = ViTConfig(image_size=side, patch_size=16 if size == "bench" else 8,
                       hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=4 * width, num_labels=100)
    model = ViTForImageClassification(config).cuda().train()
    g = _generator()
    return ZooModel(
        "hf_vit", "transformers", model, _adamw, None,
        {"pixel_values": _images(g, batch, side), "labels": _classes(g, batch, 100)},
        lambda b: ((), {"pixel_values": _images(_generator(b), b, side)}),
        f"ViT {layers} layers d{width}, {batch}x{side}x{side}", True)


def _vision(name: str, library: str, model: nn.Module, batch: int, side: int, classes: int,
            make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], description: str,
            is_transformer: bool) -> ZooModel:
    g = _generator()
    return ZooModel(
        name, library, model.cuda().train(), make_optimizer, nn.functional.cross_entropy,
        (_images(g, batch, side), _classes(g, batch, classes)),
        lambda b: ((_images(_generator(b), b, side),), {}), description, is_transformer)


def timm_vit(size: str) -> ZooModel:
    import timm

    if size == "bench":
        model = timm.create_model("vit_small_patch16_224", pretrained=False)
        return _vision("timm_vit_s16", "timm", model, 16, 224, 1000, _adamw,
                       "ViT-S/16, 16x224x224", True)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, depth=2, embed_dim=64, num_heads=4, num_classes=10)
    return _vision("timm_vit_s16", "timm", model, 4, 32, 10, _adamw, "tiny ViT", True)


def timm_convnext(size: str) -> ZooModel:
    import timm

    if size == "bench":
        model = timm.create_model("convnext_tiny", pretrained=False)
        return _vision("timm_convnext_t", "timm", model, 16, 224, 1000, _adamw,
                       "ConvNeXt-T, 16x224x224", False)
    model = timm.create_model("convnext_tiny", pretrained=False, depths=(1, 1, 1, 1),
                              dims=(16, 32, 64, 128), num_classes=10)
    return _vision("timm_convnext_t", "timm", model, 4, 64, 10, _adamw, "tiny ConvNeXt", False)


def _torchvision(name: str, architecture: str, size: str, bench_side: int,
                 make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 label: str) -> ZooModel:
    import torchvision

    classes = 1000 if size == "bench" else 10
    model = getattr(torchvision.models, architecture)(num_classes=classes)
    batch, side = (16, bench_side) if size == "bench" else (4, 64)
    return _vision(name, "torchvision", model, batch, side, classes, make_optimizer,
                   f"{label}, {batch}x3x{side}x{side}", False)


def resnet18(size: str) -> ZooModel:
    return _torchvision("tv_resnet18", "resnet18", size, 128, _sgd_momentum,
                        "ResNet-18 (BatchNorm, SGD momentum)")


def mobilenet_v3(size: str) -> ZooModel:
    return _torchvision("tv_mobilenet_v3", "mobilenet_v3_small", size, 224, _adamw,
                        "MobileNetV3-Small")


BUILDERS: Dict[str, Callable[[str], ZooModel]] = {
    "hf_gpt2": gpt2, "hf_llama": llama, "hf_bert": bert, "hf_t5": t5, "hf_vit": hf_vit,
    "timm_vit_s16": timm_vit, "timm_convnext_t": timm_convnext, "tv_resnet18": resnet18,
    "tv_mobilenet_v3": mobilenet_v3,
}


def build(name: str, size: str = "bench", seed: int = 0) -> ZooModel:
    """Builds zoo model ``name`` at ``size`` ("bench" or "test") from seed ``seed``."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    torch.manual_seed(seed)
    return BUILDERS[name](size)
