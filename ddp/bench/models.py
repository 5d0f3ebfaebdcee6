"""The benchmark's models (torch.nn only, sized by a table) and their seeded data."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn

class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input, then relu (ResNet's basic block)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet(widths: Sequence[int], classes: int) -> nn.Module:
    """A stem, then per width a stride-2 conv (after the first) and one residual block,
    global average pooling and a linear classifier."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                               nn.BatchNorm2d(widths[0]), nn.ReLU()]
    c = widths[0]
    for i, w in enumerate(widths):
        if i:
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU()]
        c = w
        layers.append(ResidualBlock(c))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


class TinyBert(nn.Module):
    """Token and position embeddings, post-norm encoder layers, a vocabulary head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]]))


#: model -> size -> hyper-parameters; "quick" is the --quick size
MODEL_SIZES = {
    "resnet": {"full": dict(widths=(64, 128, 256, 512), classes=100, image=8, batch=8),
               "quick": dict(widths=(32, 64, 128, 256), classes=100, image=8, batch=8)},
    "bert": {"full": dict(vocab=8192, d=256, layers=2, heads=4, ff=1024, seq=32, batch=4),
             "quick": dict(vocab=4096, d=128, layers=2, heads=4, ff=512, seq=32, batch=8)},
    "mlp": {"full": dict(widths=(512, 2048, 2048, 2048, 10), batch=32),
            "quick": dict(widths=(512, 1024, 1024, 10), batch=32)},
}


def mlp(widths: Sequence[int]) -> nn.Module:
    """Linear layers of the given widths with ReLUs between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


@dataclasses.dataclass
class ModelSpec:
    """One benchmark model: how to build it, its seeded data and its loss."""

    name: str
    hp: dict
    seed: int

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)  # same initial weights on every rank and configuration
        h = self.hp
        if self.name == "resnet":
            return resnet(h["widths"], h["classes"])
        if self.name == "mlp":
            return mlp(h["widths"])
        return TinyBert(h["vocab"], h["d"], h["layers"], h["heads"], h["ff"], h["seq"])

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch of step ``step`` (deterministic)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        h = self.hp
        if self.name == "resnet":
            x = torch.randn(h["batch"], 3, h["image"], h["image"], generator=g)
            return x, torch.randint(0, h["classes"], (h["batch"],), generator=g)
        if self.name == "mlp":
            x = torch.randn(h["batch"], h["widths"][0], generator=g)
            return x, torch.randint(0, h["widths"][-1], (h["batch"],), generator=g)
        x = torch.randint(0, h["vocab"], (h["batch"], h["seq"]), generator=g)
        return x, torch.randint(0, h["vocab"], (h["batch"], h["seq"]), generator=g)

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def describe(self, module: nn.Module) -> dict:
        params = [p for p in module.parameters() if p.requires_grad]
        h = self.hp
        if self.name == "resnet":
            what = (f"ResNet-style CNN: widths {list(h['widths'])}, one residual block each, "
                    f"{h['classes']} classes; input 3x{h['image']}x{h['image']}")
            sample = f"3x{h['image']}x{h['image']} images"
        elif self.name == "mlp":
            what = f"MLP: widths {' -> '.join(str(w) for w in h['widths'])}, ReLUs between"
            sample = f"vectors of {h['widths'][0]}"
        else:
            what = (f"BERT-style encoder: vocabulary {h['vocab']}, d_model {h['d']}, "
                    f"{h['layers']} TransformerEncoderLayers ({h['heads']} heads, ff {h['ff']}), "
                    f"vocabulary head; sequences of {h['seq']} tokens")
            sample = f"sequences of {h['seq']} tokens"
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        return {"description": what, "parameters": sum(p.numel() for p in params),
                "parameter_tensors": len(params), "gradient_bytes": grad_bytes,
                "gradient_mib": round(grad_bytes / 2**20, 2), "batch_per_rank": h["batch"],
                "sample": sample}
