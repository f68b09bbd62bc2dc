"""The scenario corpus: small models, built in code, that reproduce the classic failures of
gradient flow (the seed's troubleshooting table) and healthy controls, trained on the CPU."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import gradtrack
from gradtrack.formats.event import AlertEvent
from gradtrack.sinks import MemorySink

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Run:
    """What a scenario's training produced: every record and event, and its watcher."""

    sink: MemorySink
    watcher: gradtrack.Watcher
    losses: list[float] = field(default_factory=list)

    def events(self, rule: str | None = None) -> list[AlertEvent]:
        return [e for e in self.sink.events if rule is None or e.rule == rule]

    def loud(self) -> list[AlertEvent]:
        """Events a user is notified of with a warning or an error."""
        return [e for e in self.sink.events if e.severity in ("warning", "error")]


def train(
    model: nn.Module,
    batch: Batch,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    lr: float = 1e-3,
    optimizer: str = "adam",
    before: Callable[[int], None] = lambda step: None,
    **overrides: Any,
) -> Run:
    """A plain training loop with ``gradtrack.watch``'s defaults (``log_every=10`` …), on
    one thread: these models are too small to gain from more, and on a shared machine
    competing threads make them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, batch, loss_of, steps, lr, optimizer, before, **overrides)
    finally:
        torch.set_num_threads(threads)


def _train(
    model: nn.Module,
    batch: Batch,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    lr: float,
    optimizer: str,
    before: Callable[[int], None],
    **overrides: Any,
) -> Run:
    opt = make_optimizer(optimizer, model.parameters(), lr)
    sink = MemorySink()
    losses = []
    with gradtrack.watch(model, backend=sink, optimizer=opt, **overrides) as watcher:
        for step in range(steps):
            before(step)
            inputs, targets = batch(step)
            opt.zero_grad()
            loss = loss_of(model(inputs), targets)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return Run(sink, watcher, losses)


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``adam``, ``adamw`` (no warmup: the rate from the first step), ``rmsprop``, ``sgd``,
    ``momentum`` (SGD with momentum 0.9) or ``nesterov`` (the same, Nesterov's)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr)
    momentum = 0.0 if name == "sgd" else 0.9
    return torch.optim.SGD(params, lr, momentum=momentum, nesterov=name == "nesterov")


def regression_batch(width: int, batch_size: int = 32) -> Batch:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(batch_size, width, generator=generator)
        return x, x[:, :1].sin()

    return batch


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


# -- faults ----------------------------------------------------------------------------------
class Block(nn.Module):
    """Linear + GELU with a residual; ``fault`` (set per step) breaks its numerics:
    ``"forward_log"``: log of its negative pre-activations (NaN in the forward pass);
    ``"backward_sqrt"``: the norm of a zero vector on its input (finite forward, NaN in the
    backward of an op of this block itself, not of its Linear)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.fault: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault == "backward_sqrt":
            x = x + (x - x).pow(2).sum(-1, keepdim=True).sqrt()  # d sqrt(0) = inf, × 0 = NaN
        h = self.lin(x)
        if self.fault == "forward_log":
            h = torch.log(h)  # NaN where h < 0
        return x + nn.functional.gelu(h)


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sigmoid_mlp(depth: int = 8, width: int = 32) -> nn.Sequential:
    """The textbook vanishing gradient: each sigmoid passes back at most a quarter."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def relu_mlp(depth: int = 5, width: int = 32) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    layers[-1] = nn.Linear(width, 1)
    return nn.Sequential(*layers)


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def bottleneck_mlp(width: int = 32) -> nn.Sequential:
    """Layer 4's output scaled by 1e-6: every layer up to it starves."""
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), Scale(1e-6), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 1),
    )  # fmt: skip


class SaturatedRNN(nn.Module):
    """A tanh RNN whose inputs are so large that tanh returns exactly ±1: zero gradients
    without a single ReLU in the model."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.rnn = nn.RNN(width, width, batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x * 1e8)
        return self.head(out[:, -1])


def sequence_batch(width: int = 16, length: int = 8, batch_size: int = 16) -> Batch:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(batch_size, length, width, generator=generator)
        return x, x[:, :, :1].mean(1).tanh()

    return batch


# -- healthy controls ------------------------------------------------------------------------
class PreLNBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        att = nn.functional.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True
        )
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class PreLNTransformer(nn.Module):
    """Token and position embeddings, pre-LN blocks, a final LayerNorm, a learnt scalar gain
    on the logits and a separate output projection."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 16, dim))
        self.blocks = nn.ModuleList(PreLNBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x)) * self.gain


class GPT2Like(nn.Module):
    """GPT-2's layout: wte tied to the output projection, learnt wpe, fused qkv (c_attn),
    c_proj, GELU MLP, pre-LN, ln_f, GPT-2's initialisation (std 0.02, scaled c_proj)."""

    def __init__(self, vocab: int = 96, dim: int = 32, depth: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(16, dim)
        self.h = nn.ModuleList(GPT2Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if "c_proj" in name else 0.02
                nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.ModuleDict(
            {"c_attn": nn.Linear(dim, 3 * dim), "c_proj": nn.Linear(dim, dim)}
        )
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict(
            {"c_fc": nn.Linear(dim, 4 * dim), "c_proj": nn.Linear(4 * dim, dim)}
        )
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn["c_attn"](self.ln_1(x)).split(d, dim=2)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        att = nn.functional.scaled_dot_product_attention(
            split(q), split(k), split(v), is_causal=True
        )
        x = x + self.attn["c_proj"](att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp["c_proj"](nn.functional.gelu(self.mlp["c_fc"](self.ln_2(x))))


def token_batch(vocab: int, length: int = 16, batch_size: int = 8) -> Batch:
    """A learnable language: each token is the previous one plus one, from a random start."""

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        start = torch.randint(vocab, (batch_size, 1), generator=generator)
        tokens = (start + torch.arange(length + 1)) % vocab
        return tokens[:, :-1], tokens[:, 1:]

    return batch


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LSTMRegressor(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 16) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def image_batch(batch_size: int = 8) -> Batch:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        images = torch.randn(batch_size, 3, 32, 32, generator=generator)
        return images, (images[:, 0].mean((1, 2)) > 0).long()

    return batch


def prototype_batch(batch_size: int = 16, noise: float = 1.0) -> Batch:
    """Ten classes, each a fixed random image plus noise: a CNN learns it in ~30 steps."""
    prototypes = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(123))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        labels = torch.randint(10, (batch_size,), generator=generator)
        noisy = prototypes[labels] + noise * torch.randn(batch_size, 3, 32, 32, generator=generator)
        return noisy, labels

    return batch


def image_mlp() -> nn.Sequential:
    """A ReLU MLP on the flattened 3×32×32 images of `prototype_batch`."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def wide_cnn() -> nn.Sequential:
    """Wider than the quickstart CNN, with a hidden dense layer: 5×5 then 3×3 convolutions."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def batchnorm_cnn() -> nn.Sequential:
    """The quickstart CNN with a BatchNorm after each convolution."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets)


class BertLike(nn.Module):
    """A post-LN encoder (BERT's layout: embeddings, LayerNorm, post-LN blocks, a pooler)."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(16, dim)
        self.norm = nn.LayerNorm(dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens) + self.pos(torch.arange(tokens.shape[1])))
        pooled = torch.tanh(self.pooler(self.encoder(x)[:, 0]))
        return self.classifier(pooled)


def parity_batch(vocab: int = 64, length: int = 16, batch_size: int = 16) -> Batch:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(vocab, (batch_size, length), generator=generator)
        return tokens, (tokens[:, 1] % 2)

    return batch


def manual_bce(p: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy written by hand: 0 · log(0) is NaN where p is exactly 0 or 1."""
    return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()


class SaturatingClassifier(nn.Module):
    """A sigmoid output; ``sharp`` (set per step) makes it exactly 0 or 1 in float32."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.sharp = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logit = self.body(x)
        return torch.sigmoid(logit * (1e4 if self.sharp else 1.0))


def binary_batch(width: int = 16, batch_size: int = 32) -> Batch:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(batch_size, width, generator=generator)
        return x, (x[:, :1] > 0).float()

    return batch


class Logits(nn.Module):
    """A Hugging Face model (built from a config: no download) as tokens → logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens).logits


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=3, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Logits(GPT2LMHeadModel(config))


def hf_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return Logits(BertForSequenceClassification(config))


def hf_llama(depth: int = 32) -> nn.Module:
    """A deep LLaMA-shaped decoder (RMSNorm, SwiGLU, rotary attention) of tiny width."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
    )  # fmt: skip
    return Logits(LlamaForCausalLM(config))
