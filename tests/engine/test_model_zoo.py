"""A zoo of small models of many architectures, trained through the engine for 3 steps and
compared with plain PyTorch + torch.optim.AdamW(fused=True) (fp32 on the CPU, world size 1):
losses, parameters, buffers and an eval forward (see ``same`` for what is bit for bit). Then
what the zoo found: embeddings with max_norm refused, pre-hooks that read weights, a released
weight read after a step, and weights read outside their unit's call."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiered

from helpers import REPO

OPTIM = dict(lr=1e-2, weight_decay=0.1)
STEPS = 3


def images(g):
    return (torch.randn(4, 3, 8, 8, generator=g),)


def sequences(g, shape=(4, 5, 8)):
    return (torch.randn(*shape, generator=g),)


def tokens(g):
    return (torch.randint(0, 20, (4, 6), generator=g),)


def loss_of(out) -> torch.Tensor:
    leaves = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else (out,)
    return sum((t.float() ** 2).mean() for t in leaves)


def same(value, reference, exact=False, what=""):
    """Bit for bit where it holds for every model here: the first step's loss (same weights,
    same kernels) and integer buffers. Parameters to DESIGN's rtol 1e-5 / atol 1e-6: after 3
    steps the weight_norm model's ``2.bias`` differed by 1.9e-9 (cause not pinned down; the
    fused kernel alone gave equal results at shard offsets 1 to 17 in a direct check)."""
    if exact or not value.is_floating_point():
        assert torch.equal(value, reference), f"{what}: {value} != {reference}"
    else:
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {m}")


def parity(make, data=images, steps=STEPS):
    """Train ``make()`` for ``steps`` on the engine and on plain PyTorch; compare losses, the
    state dicts (keys and values, buffers too), then an eval forward under no_grad."""
    torch.manual_seed(0)
    reference = make()
    torch.manual_seed(0)
    model = make()  # not deepcopy: torch.nn.utils.weight_norm's modules refuse it
    keys = list(reference.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True, **OPTIM)
    engine, optimizer = tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                                          compute_dtype="fp32", device="cpu", optimizer=OPTIM)

    def same_states(when):
        state, ref_state = engine.full_state_dict(), reference.state_dict()
        assert list(state) == keys == list(ref_state)
        for name in keys:
            same(state[name], ref_state[name], what=f"{name} {when}")

    try:
        g = torch.Generator().manual_seed(1)
        batches = [data(g) for _ in range(steps + 1)]
        for step, batch in enumerate(batches[:steps]):
            loss, ref_loss = loss_of(engine(*batch)), loss_of(reference(*batch))
            same(loss, ref_loss, exact=step == 0, what=f"loss of step {step}")
            loss.backward(), ref_loss.backward()
            optimizer.step(), ref_opt.step()
            optimizer.zero_grad(), ref_opt.zero_grad()
        same_states(f"after {steps} steps")
        engine.eval(), reference.eval()
        with torch.no_grad():
            out, ref_out = engine(*batches[-1]), reference(*batches[-1])
        same(loss_of(out), loss_of(ref_out), what="eval forward")
        same_states("after an eval forward")
    finally:
        engine.close()


# --- models ------------------------------------------------------------------------------


def conv_bn(momentum=0.1):
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class Recurrent(nn.Module):
    def __init__(self, kind, **kwargs):
        super().__init__()
        self.rnn = kind(8, 16, num_layers=2, batch_first=True, **kwargs)
        self.head = nn.Linear(16 * (2 if kwargs.get("bidirectional") else 1), 4)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


class Attention(nn.Module):
    """in_proj_weight read by F.multi_head_attention_forward; with kdim/vdim, separate q/k/v
    projections and in_proj_weight registered as None."""

    def __init__(self, batch_first, kv=False):
        super().__init__()
        self.kv = kv
        dims = dict(kdim=6, vdim=4) if kv else {}
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **dims)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        out, weights = self.attn(x, x[..., :6], x[..., :4]) if self.kv else self.attn(x, x, x)
        return self.head(out), weights


def encoder():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(8, 4))


class Tokens(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.emb = embedding
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        if isinstance(self.emb, nn.EmbeddingBag):
            return self.head(self.emb(idx.flatten(), torch.arange(0, idx.numel(), 3)))
        return self.head(self.emb(idx))


def tied():
    """An embedding and an output head in different modules share one weight."""
    model = nn.Sequential(nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.Tanh()),
                          nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 20, bias=False)))
    model[1][1].weight = model[0][0].weight
    return model


class Scaled(nn.Module):
    """A block that reads its own parameter in its forward, next to its child's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.gain + x


class ParentParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Scaled(), Scaled()])
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) + self.bias
        return x


class ReadsChildWeights(nn.Module):
    """The parent computes with its children's weights without calling them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(F.linear(x, layer.weight, layer.bias))
        return x


def parametrized(fn):
    return nn.Sequential(fn(nn.Linear(8, 16)), nn.Tanh(), fn(nn.Linear(16, 4)))


class Functional(nn.Module):
    """torch.func.functional_call with weights computed from the module's own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8, 1) * 0.5)

    def forward(self, x):
        weight = self.fc.weight * self.scale
        return torch.func.functional_call(self.fc, {"weight": weight}, (x,))


class Outputs(nn.Module):
    def __init__(self, as_dict):
        super().__init__()
        self.as_dict = as_dict
        self.trunk, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return {"a": self.a(h), "b": self.b(h)} if self.as_dict else (self.a(h), self.b(h))


class RootAndDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.heads = nn.ModuleDict({"x": nn.Linear(8, 8), "y": nn.Linear(8, 8)})
        self.trunk = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.trunk(x)
        return (self.heads["x"](h) + self.heads["y"](h)) / self.temperature


WORKING = {
    "conv_bn": (conv_bn, images),
    "conv_bn_cumulative": (lambda: conv_bn(momentum=None), images),
    "mha_batch_first": (lambda: Attention(True), sequences),
    "mha_seq_first": (lambda: Attention(False), lambda g: sequences(g, (5, 4, 8))),
    "transformer_encoder": (encoder, sequences),
    "embedding_padding_idx": (lambda: Tokens(nn.Embedding(20, 8, padding_idx=0)), tokens),
    "embedding_bag": (lambda: Tokens(nn.EmbeddingBag(20, 8, mode="mean")), tokens),
    "tied_across_modules": (tied, tokens),
    "parent_param": (ParentParam, sequences),
    "weight_norm": (lambda: parametrized(nn.utils.parametrizations.weight_norm), sequences),
    "spectral_norm": (lambda: parametrized(nn.utils.parametrizations.spectral_norm), sequences),
    "functional_call": (Functional, sequences),
    "prelu": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(40, 8), nn.PReLU(8),
                                    nn.Linear(8, 4)), sequences),
    "layernorm_no_affine": (lambda: nn.Sequential(
        nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 4)), sequences),
    "dict_output": (lambda: Outputs(True), sequences),
    "tuple_output": (lambda: Outputs(False), sequences),
    "root_param_module_dict": (RootAndDict, sequences),
    "lstm": (lambda: Recurrent(nn.LSTM), sequences),
    "gru": (lambda: Recurrent(nn.GRU, bidirectional=True), sequences),
    "mha_kdim_vdim": (lambda: Attention(True, kv=True), sequences),
}


@pytest.mark.parametrize("name", list(WORKING))
def test_trains_like_pytorch(name):
    make, data = WORKING[name]
    parity(make, data)


def test_transformer_encoder_eval_forward_matches_pytorch_fast_path():
    """In eval under no_grad, PyTorch takes the encoder layer's fast path; the engine's hooks on
    the layers make torch fall back to the slow path (it refuses modules with hooks): the same
    math, so the outputs are equal. Checked before any step, so bit for bit."""
    torch.manual_seed(0)
    reference = encoder().eval()
    torch.manual_seed(0)
    engine, _ = tiered.initialize(encoder(), os.path.join(REPO, "configs", "cpu.yaml"),
                                  compute_dtype="fp32", device="cpu")
    try:
        x = torch.randn(4, 5, 8)
        with torch.no_grad():
            assert torch.equal(engine.eval()(x), reference(x))
    finally:
        engine.close()


# --- findings -----------------------------------------------------------------------------


@pytest.mark.parametrize("embedding", [nn.Embedding(20, 8, max_norm=1.0),
                                       nn.EmbeddingBag(20, 8, max_norm=1.0)],
                         ids=["embedding", "bag"])
def test_an_embedding_with_max_norm_is_refused_at_initialize_by_name(embedding):
    """max_norm renormalizes the weight in place in forward: under the engine that wrote a
    gathered copy only (training crashed in torch.embedding, a view modified in place; under
    no_grad the master weights silently stayed unrenormalized)."""
    model = Tokens(embedding)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(tiered.TieredError, match=r"^emb: an embedding with max_norm"):
        tiered.initialize(model, os.path.join(REPO, "configs", "cpu.yaml"),
                          compute_dtype="fp32", device="cpu")
    after = model.state_dict()  # refused before anything was taken from the model
    assert all(torch.equal(after[name], value) for name, value in before.items())


class ReadsBeforeCalling(nn.Module):
    """functional_call on a unit with weights derived from its own: read before it runs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.scale = nn.Parameter(torch.full((8, 1), 0.5))

    def forward(self, x):
        for layer in self.layers:
            weight = layer.weight * self.scale
            x = torch.tanh(torch.func.functional_call(layer, {"weight": weight}, (x,)))
        return x


@pytest.mark.parametrize("make", [ReadsChildWeights, ReadsBeforeCalling],
                         ids=["parent_reads_child_weights", "functional_call_on_a_unit"])
def test_weights_read_outside_their_unit_are_refused_by_name(make):
    """A unit holds its weights only around its module's call; a parent reading a child's
    weight (DeepSpeed asks for register_external_parameter there) failed with AttributeError,
    then with a meta-device error from inside torch. It is refused naming the remedy."""
    with pytest.raises(tiered.TieredError,
                       match=r"was used outside the forward of its unit .*units\.classes"):
        parity(make, sequences)


class PreHooked(nn.Module):
    """A forward pre-hook registered before initialize reads the weights (a logging hook)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.norms = []
        for layer in self.layers:
            layer.register_forward_pre_hook(lambda m, a: self.norms.append(m.weight.norm()))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def legacy(fn):
    return lambda: nn.Sequential(fn(nn.Linear(8, 16)), nn.Tanh(), fn(nn.Linear(16, 8)))


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("make", [PreHooked, legacy(nn.utils.spectral_norm),
                                  legacy(nn.utils.weight_norm)],
                         ids=["user_pre_hook", "legacy_spectral_norm", "legacy_weight_norm"])
def test_forward_pre_hooks_see_gathered_weights(make):
    parity(make, sequences)


READ_AFTER_STEP = """
import torch, tiered
from torch import nn
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
engine, optimizer = tiered.initialize(model, {policy!r}, compute_dtype="fp32", device="cpu")
engine(torch.randn(2, 8)).sum().backward()
optimizer.step()
print(model[0].weight.shape)  # inspecting a weight, as a user or a debugger does
try:
    print(model[0].weight.sum().tolist())
except Exception as error:  # a Python error is what reading it may give; a crash is not
    print(type(error).__name__, error)
"""


def test_reading_a_released_weight_does_not_crash_the_process():
    code = READ_AFTER_STEP.format(policy=os.path.join(REPO, "configs", "cpu.yaml"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    shape, values = done.stdout.splitlines()[-2:]
    assert shape == "torch.Size([8, 8])", done.stdout  # a released weight keeps its shape
    assert values.startswith("TieredError 0.weight was used outside the forward of its unit"), \
        done.stdout  # and refuses its values, by name
