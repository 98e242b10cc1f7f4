"""Models used in the CROSSBOW experiments: LeNet, an MLP and the CIFAR ResNet-32; a small attention model for
synthetic-sequences; and a small GPT for language modelling."""

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from crossbow_mpi.data.datasets import SEQUENCE_VOCAB


class LeNet(nn.Module):
    """CROSSBOW's (Caffe's) LeNet: conv5x5(20), maxpool, conv5x5(50), maxpool, fc(500), ReLU, fc.

    As in Caffe, the convolutions have no activation; only the first fully connected layer does.
    """

    def __init__(self, in_channels: int = 1, input_size: int = 28, num_classes: int = 10):
        super().__init__()
        feature_size = ((input_size - 4) // 2 - 4) // 2
        if feature_size < 1:
            raise ValueError(f"LeNet needs inputs of at least 16x16, got {input_size}x{input_size}")
        self.conv1 = nn.Conv2d(in_channels, 20, kernel_size=5)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(50 * feature_size * feature_size, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.conv1(x), kernel_size=2, stride=2)
        x = F.max_pool2d(self.conv2(x), kernel_size=2, stride=2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)

    def pipeline_modules(self) -> list[nn.Module]:
        """Return the modules that `forward` runs, in order (for pipeline stages)."""
        pool = nn.MaxPool2d(kernel_size=2, stride=2)
        return [self.conv1, pool, self.conv2, pool, nn.Flatten(), self.fc1, nn.ReLU(), self.fc2]


class MLP(nn.Module):
    """Flatten, then fully connected layers with ReLU between them."""

    def __init__(self, input_dim: int, num_classes: int, hidden_dims: Sequence[int] = (256,)):
        super().__init__()
        dims = (input_dim, *hidden_dims)
        layers: list[nn.Module] = [nn.Flatten()]
        for in_dim, out_dim in itertools.pairwise(dims):
            layers += [nn.Linear(in_dim, out_dim), nn.ReLU()]
        layers.append(nn.Linear(dims[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def pipeline_modules(self) -> list[nn.Module]:
        """Return the modules that `forward` runs, in order (for pipeline stages)."""
        return list(self.layers)


class _ZeroPadShortcut(nn.Module):
    """Option-A shortcut: subsample by `stride` and append zero channels; no parameters."""

    def __init__(self, stride: int, extra_channels: int):
        super().__init__()
        self.stride = stride
        self.extra_channels = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, 0, self.extra_channels))


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride == 1 and in_channels == out_channels:
            self.shortcut: nn.Module = nn.Identity()
        else:
            self.shortcut = _ZeroPadShortcut(stride, out_channels - in_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al. (2016) CIFAR ResNet of depth 6n+2 with option-A (zero-padding) shortcuts.

    Three stages of `blocks_per_stage` basic blocks at 16/32/64 channels, then global average
    pooling and one fully connected layer. `blocks_per_stage=5` is ResNet-32 (31 convs + 1 fc).
    """

    def __init__(self, blocks_per_stage: int = 5, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks = []
        channels = 16
        for stage_channels, stage_stride in ((16, 1), (32, 2), (64, 2)):
            for block_index in range(blocks_per_stage):
                stride = stage_stride if block_index == 0 else 1
                blocks.append(_BasicBlock(channels, stage_channels, stride))
                channels = stage_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(x.mean(dim=(2, 3)))

    def pipeline_modules(self) -> list[nn.Module]:
        """Return the modules that `forward` runs, in order (for pipeline stages)."""
        return [self.conv, self.bn, nn.ReLU(), *self.blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), self.fc]


class _Block(nn.Module):
    """A pre-LayerNorm Transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        x = x + self.resid_dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-style decoder (Karpathy's nanoGPT, after GPT-2): token and position embeddings, `layers` pre-LayerNorm
    blocks of causal self-attention and an MLP, a final LayerNorm, and an output layer tied to the token embedding.
    Input: [B, T] token indices; output: [B, T, vocab] next-token scores."""

    def __init__(
        self, vocab: int, seq_len: int, layers: int = 2, heads: int = 4, width: int = 128, dropout: float = 0.0
    ):
        super().__init__()
        if width % heads:
            raise ValueError(f"tinygpt: the embedding width {width} is not divisible by the {heads} heads")
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Block(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:  # nanoGPT's initialisation: N(0, 0.02), residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(parameter, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.tokens(tokens) + self.positions(positions))
        return self.head(self.ln(self.blocks(x)))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [B, T, V] scores against [B, T] labels."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class Attention(nn.Module):
    """A one-block attention classifier of token sequences (synthetic-sequences): token and position embeddings,
    self-attention and a feed-forward layer, each residual with LayerNorm, then the mean over positions. Its cost
    grows with the sequence length, so batches of different lengths take different times."""

    def __init__(self, vocab: int, max_length: int, num_classes: int, width: int = 32, heads: int = 4):
        super().__init__()
        if width % heads:
            raise ValueError(f"attention: the width {width} is not divisible by the {heads} heads")
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.02 * torch.randn(max_length, width))
        self.attend = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(width)
        self.feed = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
        self.norm2 = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.long()
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        h = self.norm1(h + self.attend(h, h, h, need_weights=False)[0])
        h = self.norm2(h + self.feed(h))
        return self.head(h.mean(dim=1))


def _check_image_shape(name: str, input_shape: tuple[int, ...], square: bool) -> None:
    if len(input_shape) != 3 or (square and input_shape[1] != input_shape[2]):
        kind = "a square (C, H, W)" if square else "a (C, H, W)"
        raise ValueError(f"model {name!r} needs {kind} input shape, got {input_shape}")


def _build_lenet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    _check_image_shape("lenet", input_shape, square=True)
    return LeNet(input_shape[0], input_shape[1], num_classes)


def _build_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MLP(math.prod(input_shape), num_classes)


def _build_resnet32(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    _check_image_shape("resnet32", input_shape, square=False)
    return CifarResNet(blocks_per_stage=5, in_channels=input_shape[0], num_classes=num_classes)


def _build_attention(input_shape: tuple[int, ...], num_classes: int, **sizes) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(f"model 'attention' needs token sequences of shape (length,), got {input_shape}")
    return Attention(SEQUENCE_VOCAB, input_shape[0], num_classes, **sizes)


def _build_tinygpt(input_shape: tuple[int, ...], num_classes: int, **sizes) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(f"model 'tinygpt' needs [T] token windows (--dataset text), got input shape {input_shape}")
    return TinyGPT(num_classes, input_shape[0], **sizes)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "attention": _build_attention,
    "lenet": _build_lenet,
    "mlp": _build_mlp,
    "resnet32": _build_resnet32,
    "tinygpt": _build_tinygpt,
}
MODEL_ARGS: dict[str, dict[str, type]] = {
    "attention": {"width": int, "heads": int},
    "tinygpt": {"layers": int, "heads": int, "width": int, "dropout": float},
}
"""The `--model-args` each model takes, with their types."""
LANGUAGE_MODELS = ("tinygpt",)
"""Models trained with `token_cross_entropy`."""


def model_names() -> list[str]:
    return sorted(MODELS)


def parse_model_args(name: str, text: str) -> dict[str, int | float]:
    """Parse `--model-args` (`key=value,...`) for model `name`; ValueError naming the first bad pair."""
    known = MODEL_ARGS.get(name, {})
    sizes: dict[str, int | float] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = pair.partition("=")
        if key not in known:
            takes = ", ".join(known) or "none"
            raise ValueError(f"--model-args: model {name!r} has no argument {key!r} (it takes {takes})")
        kind = known[key]
        try:
            sizes[key] = kind(value)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise ValueError(f"--model-args: {key}={value!r} is not {expected}") from None
        if not (sizes[key] > 0 if kind is int else 0 <= sizes[key] < 1):
            raise ValueError(f"--model-args: {key} must be {'positive' if kind is int else 'in [0, 1)'}, got {value}")
    return sizes


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, args: str = "") -> nn.Module:
    """Build model `name` for inputs of `input_shape` (without the batch dimension), sized by `--model-args`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    return MODELS[name](tuple(input_shape), num_classes, **parse_model_args(name, args))
