"""Small-scale training: AdamW with warm-up and cosine decay, the best-validation checkpoint saved atomically."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, TrainingError
from .formats.checkpoint import save_checkpoint
from .torch_engine.model import GPT


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1500
    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 64  # validation windows per evaluation: bounded so evaluation stays cheap
    seed: int = 1337


@dataclass(frozen=True)
class Dataset:
    train_ids: torch.Tensor
    val_ids: torch.Tensor
    val_chars: int  # characters of validation text, to report loss per character

    @property
    def val_tokens_per_char(self) -> float:
        return len(self.val_ids) / self.val_chars


@dataclass(frozen=True)
class TrainEvent:
    step: int
    train_loss: float
    tokens_per_s: float
    elapsed_s: float
    eta_s: float
    val_loss: float | None = None  # nats per token, at evaluation steps
    val_loss_per_char: float | None = None
    saved: bool = False  # a new best checkpoint was written


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """The last val_fraction of the text is held out, as nanoGPT's shakespeare split does."""
    cut = int(len(text) * (1.0 - val_fraction))
    return text[:cut], text[cut:]


def make_dataset(text: str, encode, val_fraction: float, block_size: int) -> Dataset:
    train_text, val_text = split_text(text, val_fraction)
    train_ids = torch.tensor(encode(train_text), dtype=torch.long)
    val_ids = torch.tensor(encode(val_text), dtype=torch.long)
    for name, ids in (("training", train_ids), ("validation", val_ids)):
        if len(ids) < 2 * (block_size + 1):
            raise InputError(
                f"the {name} text has {len(ids)} tokens, fewer than two blocks of {block_size}: "
                "use more text, a smaller --block-size or another --val-fraction"
            )
    return Dataset(train_ids, val_ids, len(val_text))


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    min_lr = settings.min_lr if settings.min_lr is not None else settings.lr / 10
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (settings.lr - min_lr)


def random_batch(ids: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator):
    starts = torch.randint(len(ids) - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = ids[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, ids: torch.Tensor, max_windows: int | None = None, batch_size: int = 16) -> float:
    """Mean loss per token over non-overlapping windows (evenly spaced max_windows of them if given)."""
    block_size = model.config.block_size
    count = (len(ids) - 1) // block_size
    starts = torch.arange(count) * block_size
    if max_windows is not None and count > max_windows:
        starts = starts[torch.linspace(0, count - 1, max_windows).long()]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    offsets = torch.arange(block_size + 1)
    for chunk in starts.split(batch_size):
        windows = ids[chunk[:, None] + offsets].to(device)
        _, loss = model(windows[:, :-1], windows[:, 1:])
        total += loss.item() * len(chunk)
    model.train(was_training)
    return total / len(starts)


def make_optimizer(model: GPT, settings: TrainSettings, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only (not biases, norms); the fused kernel where the device has one."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.99), fused=device.type in ("cpu", "cuda"))


def train(
    model: GPT,
    data: Dataset,
    settings: TrainSettings,
    out_path: str | Path,
    tokenizer_spec: dict,
    start_step: int = 0,
    best_val_loss: float = math.inf,
    *,
    overwrite: bool = False,
) -> Iterator[TrainEvent]:
    """Train from start_step to settings.steps, yielding an event per step; the best-validation model is saved
    atomically at each evaluation (and at the last step), so an interrupted run keeps its best checkpoint.

    The first save replaces an existing out_path only with overwrite; later saves replace the run's own file. A loss
    that becomes NaN or infinite stops the run with TrainingError, the last good checkpoint kept.
    """
    device = next(model.parameters()).device
    block_size = model.config.block_size
    optimizer = make_optimizer(model, settings, device)
    generator = torch.Generator().manual_seed((settings.seed + start_step) % 2**64)
    model.train()
    started = time.perf_counter()
    tokens_per_step = settings.batch_size * block_size
    best_step = start_step if math.isfinite(best_val_loss) else None  # the step the checkpoint at out_path holds
    for step in range(start_step, settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        x, y = random_batch(data.train_ids, block_size, settings.batch_size, generator)
        _, loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()

        done = step + 1
        train_loss = check_finite(loss.item(), "training", done, out_path, best_step)
        elapsed = time.perf_counter() - started
        rate = (done - start_step) * tokens_per_step / elapsed
        event = dict(
            step=done,
            train_loss=train_loss,
            tokens_per_s=rate,
            elapsed_s=elapsed,
            eta_s=(settings.steps - done) * tokens_per_step / rate,
        )
        if done % settings.eval_every == 0 or done == settings.steps:
            val_loss = check_finite(
                evaluate(model, data.val_ids, settings.eval_windows), "validation", done, out_path, best_step
            )
            saved = val_loss < best_val_loss
            if saved:
                best_val_loss, best_step = val_loss, done
                metadata = {"training": json.dumps({"step": done, "val_loss": val_loss})}
                save_checkpoint(out_path, model, tokenizer_spec, metadata, overwrite=overwrite)
                overwrite = True  # the name is ours now: later bests replace it
            event.update(val_loss=val_loss, val_loss_per_char=val_loss * data.val_tokens_per_char, saved=saved)
        yield TrainEvent(**event)


def check_finite(loss: float, what: str, step: int, out_path: str | Path, best_step: int | None) -> float:
    """The loss, or TrainingError when it is NaN or infinite: the weights are ruined, and training on is pointless."""
    if math.isfinite(loss):
        return loss
    kept = (
        f"{out_path} keeps the best checkpoint, of step {best_step}"
        if best_step is not None
        else f"nothing was written to {out_path}"
    )
    raise TrainingError(f"the {what} loss became {loss} at step {step} (diverged: try a smaller --lr); {kept}")
