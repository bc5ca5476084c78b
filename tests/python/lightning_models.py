"""Models, data, a metrics logger and an eager stand-in for the captured step,
shared by test_lightning.py (CPU) and test_lightning_gpu.py."""

import torch
from torch import nn

import lightning.pytorch as pl

from graphed.integrations.lightning import CUDAGraphs, StepEngine
from graphed.train import split_batch


class ListLogger(pl.loggers.Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name = "list"
    version = 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def series(self, key):
        return [(step, m[key]) for step, m in self.rows if key in m]


class MLPModule(pl.LightningModule):
    """A small regression MLP; options choose the optimizer and scheduler."""

    def __init__(self, optimizer="adamw", scheduler=None, fused=None, capturable_eager=False,
                 seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
        self.optimizer_kind, self.scheduler, self.fused = optimizer, scheduler, fused
        self.capturable_eager = capturable_eager

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return configure(self, self.parameters())


def configure(module, params):
    kind = module.optimizer_kind
    extra = {} if module.fused is None else {"fused": module.fused}
    if kind == "adamw":
        optimizer = torch.optim.AdamW(params, lr=1e-2, **extra)
    elif kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9, **extra)
    elif kind == "lbfgs":
        optimizer = torch.optim.LBFGS(params, lr=1e-2)
    else:
        raise ValueError(kind)
    config = {"optimizer": optimizer}
    if module.scheduler == "step":
        config["lr_scheduler"] = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5),
                                  "interval": "step", "frequency": 2}
    elif module.scheduler == "epoch":
        config["lr_scheduler"] = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
                                  "interval": "epoch"}
    elif module.scheduler == "lambda":
        config["lr_scheduler"] = {"scheduler": torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 1.0 / (1 + step)), "interval": "step"}
    if module.capturable_eager:
        # The eager twin runs the same fused kernels on a device lr, so that
        # both sides compare bit for bit (after the scheduler saw a float lr).
        import graphed
        graphed.make_capturable(optimizer)
    return config


def regression_data(batches=10, batch_size=4, remainder=2, device="cpu", seed=1):
    generator = torch.Generator().manual_seed(seed)
    n = batches * batch_size + remainder
    x = torch.randn(n, 8, generator=generator)
    y = torch.randn(n, 1, generator=generator)
    dataset = torch.utils.data.TensorDataset(x.to(device), y.to(device))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def trainer(callbacks=(), accelerator="cpu", **kwargs):
    logger = ListLogger()
    options = dict(accelerator=accelerator, devices=1, logger=logger, log_every_n_steps=1,
                   enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False)
    options.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **options), logger


class EagerStep(StepEngine):
    """The captured step's semantics run eagerly (Note [One training
    iteration] in include/graphed/training_iteration.h), so that the CPU tier
    runs everything of the callback except the graph."""

    def __init__(self, pl_module, optimizer, settings, sample_batch, extra_args):
        super().__init__(pl_module, optimizer, settings, sample_batch, extra_args)
        self.captured()

    def step(self, batch):
        n = self.settings.microbatches
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for (micro,) in (split_batch((batch,), n) if n > 1 else [(batch,)]):
            loss = self.adapter(micro).float() / n
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.settings.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.settings.clip_grad_norm)
        self.sync_learning_rates()
        self.optimizer.step()
        return total


class CPUGraphs(CUDAGraphs):
    """CUDAGraphs with the eager stand-in for the graph, allowed on the CPU."""

    _require_cuda = False

    def _make_engine(self, pl_module, optimizer, settings, batch, extra_args):
        return EagerStep(pl_module, optimizer, settings, batch, extra_args)


class GPTModule(pl.LightningModule):
    """A tiny Hugging Face GPT-2 from its config (no dropout, no cache, sdpa
    attention: transformers' eager attention copies a host scalar into its mask
    on every call, which no graph can hold), trained on its own labels."""

    def __init__(self, layers=2, width=64, heads=4, vocab=256, length=32, fused=True,
                 capturable_eager=False, seed=0):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(seed)
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                            n_positions=length, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                            attn_implementation="sdpa")
        self.model = GPT2LMHeadModel(config)
        self.optimizer_kind, self.scheduler, self.fused = "adamw", None, fused
        self.capturable_eager = capturable_eager

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return configure(self, self.parameters())


class TokenData(torch.utils.data.Dataset):
    """Random token sequences, ``labels`` equal to ``input_ids``."""

    def __init__(self, count, length=32, vocab=256, seed=1):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def token_data(batches, batch_size=4, seed=1, **kwargs):
    return torch.utils.data.DataLoader(TokenData(batches * batch_size, seed=seed, **kwargs),
                                       batch_size=batch_size)


class StepOutputs(pl.Callback):
    """Keeps the ``loss`` each training batch returned (a device tensor)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if outputs and outputs.get("loss") is not None:
            self.losses.append(outputs["loss"].detach().float().clone())
