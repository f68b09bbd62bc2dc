"""Every statistic against an independent fp64 reference computed from ``p.grad``."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.collect import DEFER_BELOW_ELEMENTS, Collector
from gradtrack.capture.stats import PACK_BELOW_ELEMENTS, sample_bounds, sample_elements
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.layout import FlatGrads, HostPart
from gradtrack.handoff.mailbox import Mailbox, PendingStep
from gradtrack.sinks import MemorySink
from tests.conftest import assert_record_matches, reference_stats

# Where a step's statistics are reduced: by the accelerators' foreach kernels, by the CPU's on
# the training thread (a step past `DEFER_BELOW_ELEMENTS`), or by the worker from a small CPU
# step's one copy of its gradients.
COUNT_STRATEGIES = ("foreach_only", "cpu_kernels", "cpu_worker")
PER_LAYER = pytest.mark.parametrize("per_layer", [True, False], ids=["per_layer", "l2_only"])


def one_step(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    strategy: str = "cpu_worker",
    before_step: Callable[[nn.Module], None] | None = None,
    per_layer: bool = True,
    **overrides: object,
) -> StepRecord:
    """Backward once, optionally tamper with the gradients, then one optimizer step.

    ``per_layer=False``: the step measured is the second, which computes no max/mean |g|
    (``layer_every`` is 100), after a first one tampered with the same way (the first
    non-finite step of a window is summarised in full). ``strategy``: one of
    `COUNT_STRATEGIES`; each step's parts are checked to have taken it."""
    sink = MemorySink()
    deferred: list[bool] = []  # per part collected: handed to the worker to reduce
    collect = Collector.collect

    def spy(self: Collector, *args: Any, **kwargs: Any) -> list[HostPart]:
        parts = collect(self, *args, **kwargs)
        deferred.extend(part.flat is not None for part in parts)
        return parts

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    bound = 0 if strategy == "cpu_kernels" else DEFER_BELOW_ELEMENTS
    with (
        mock.patch.object(Collector, "collect", spy),
        mock.patch("gradtrack.capture.collect.DEFER_BELOW_ELEMENTS", bound),
        gradtrack.watch(
            model, backend=sink, optimizer=optimizer, log_every=1, **overrides
        ) as watcher,
    ):
        watcher.collector.foreach_only = strategy == "foreach_only"
        if not per_layer:
            weights = copy.deepcopy(model.state_dict())
            loss_fn(model).backward()
            if before_step is not None:
                before_step(model)
            optimizer.step()
            model.load_state_dict(weights)  # lr 0 still applies NaN * 0
            optimizer.zero_grad()
        loss_fn(model).backward()
        if before_step is not None:
            before_step(model)
        optimizer.step()
    assert len(sink.records) == (1 if per_layer else 2)
    trained = [p for p in model.parameters() if p.requires_grad]
    small = sum(p.numel() for p in trained) <= DEFER_BELOW_ELEMENTS
    fp32 = all(p.dtype == torch.float32 for p in trained)
    assert deferred and deferred == [strategy == "cpu_worker" and fp32 and small] * len(deferred)
    record = sink.records[-1]
    assert record.abs_stats == per_layer
    return record


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).to(dtype)


def mlp_loss(model: nn.Module) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model(x).float().pow(2).mean() * 100


def expected_by_module(model: nn.Module, names: list[str]) -> dict[str, dict[str, float]]:
    modules = dict(model.named_modules())
    return {
        name: reference_stats(
            p.grad for p in modules[name].parameters(recurse=False) if p.grad is not None
        )
        for name in names
    }


@PER_LAYER
@pytest.mark.parametrize("strategy", COUNT_STRATEGIES)
@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)],
)
def test_statistics_match_reference_per_dtype(
    dtype: torch.dtype, rtol: float, strategy: str, per_layer: bool
) -> None:
    model = mlp(dtype)
    record = one_step(model, mlp_loss, strategy, per_layer=per_layer)
    assert_record_matches(record, expected_by_module(model, ["0", "2", "4"]), rtol=rtol)
    total = reference_stats(p.grad for p in model.parameters())["norm"]
    assert record.total_norm == pytest.approx(total, rel=rtol)


@PER_LAYER
@pytest.mark.parametrize("strategy", COUNT_STRATEGIES)
def test_large_and_small_tensors_together(strategy: str, per_layer: bool) -> None:
    # On CPU, tensors of PACK_BELOW_ELEMENTS and more take another path than the small ones.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 2)
    )
    assert model[2].weight.numel() >= PACK_BELOW_ELEMENTS > model[4].weight.numel()
    # ... and past the bound below which the worker reduces a CPU step: "cpu_worker" too
    # reduces it on the training thread (`one_step` checks which way each step took).
    assert sum(p.numel() for p in model.parameters()) > DEFER_BELOW_ELEMENTS

    def inject(m: nn.Module) -> None:
        m[2].weight.grad[0, :3] = float("nan")
        m[4].weight.grad[1, 0] = float("inf")

    loss = lambda m: m(torch.randn(16, 8, generator=torch.Generator().manual_seed(1))).pow(2).mean()  # noqa: E731
    record = one_step(model, loss, strategy, inject, per_layer)
    assert_record_matches(record, expected_by_module(model, ["0", "2", "4"]), rtol=1e-5)
    assert (record.nan_count, record.inf_count) == (3, 1)


def test_fp16_gradients_whose_norm_overflows_fp16_are_reduced_in_fp32() -> None:
    model = nn.Linear(1000, 1, bias=False).half()

    def big_grads(m: nn.Module) -> None:
        m.weight.grad.fill_(60000.0)  # each element fits fp16, the norm (1.9e6) does not

    record = one_step(
        model, lambda m: m(torch.ones(1, 1000).half()).float().sum(), before_step=big_grads
    )
    assert record.column("norm")[0] == pytest.approx(60000.0 * 1000**0.5, rel=1e-3)
    assert record.column("inf")[0] == 0


def test_a_lone_float64_gradient_is_left_as_it_was() -> None:
    # A group of one small tensor: its packed copy must not be the gradient's own storage.
    model = nn.Linear(4, 1, bias=False).double()
    seen: list[torch.Tensor] = []
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0]], dtype=torch.float64)
    record = one_step(model, lambda m: m(x).sum(), before_step=lambda m: seen.append(
        m.weight.grad.clone()
    ))  # fmt: skip
    assert torch.equal(model.weight.grad, seen[0]) and torch.equal(seen[0], x)
    assert record.column("max_abs")[0] == 4.0


def test_frozen_parameters_are_skipped() -> None:
    model = mlp()
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)
    record = one_step(model, mlp_loss)
    assert record.layers == ("2", "4")
    assert record.column("numel").tolist() == [16, 51]
    assert_record_matches(record, expected_by_module(model, ["2", "4"]))


def test_layer_without_gradient_this_step_is_absent() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.used = nn.Linear(4, 1)
            self.unused = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(self.body(x))

    model = TwoHeads()
    record = one_step(model, lambda m: m(torch.randn(5, 4)).sum())
    assert record.layers == ("body", "used")
    assert_record_matches(record, expected_by_module(model, ["body", "used"]))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_zero_size_parameters() -> None:
    class WithEmpty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.empty = nn.Linear(0, 2)  # weight has shape (2, 0): zero elements
            self.nothing = nn.Module()
            self.nothing.p = nn.Parameter(torch.zeros(0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + self.empty(x[:, :0]) + self.nothing.p.sum()

    model = WithEmpty()
    record = one_step(model, lambda m: m(torch.randn(4, 3)).pow(2).sum())
    assert record.layers == ("fc", "empty", "nothing")
    assert_record_matches(record, expected_by_module(model, ["fc", "empty", "nothing"]))
    assert record.layer_stats()["nothing"] == (0.0, 0.0, 0.0, 0.0, 0, 0, 0)


def test_tied_weights_are_counted_once_under_their_first_owner() -> None:
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 8)
            self.hidden = nn.Linear(8, 8)
            self.decode = nn.Linear(8, 11)
            self.decode.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.decode(torch.tanh(self.hidden(self.embed(tokens))))

    model = TiedLM()
    record = one_step(model, lambda m: m(torch.tensor([[1, 2, 3, 2]])).logsumexp(-1).sum())
    assert record.layers == ("embed", "hidden", "decode")
    assert record.column("numel").tolist() == [88, 72, 11]  # decode keeps only its bias
    expected = expected_by_module(model, ["embed", "hidden"])
    expected["decode"] = reference_stats([model.decode.bias.grad])
    assert_record_matches(record, expected)
    total = reference_stats(p.grad for p in model.parameters())["norm"]  # parameters() dedups
    assert record.total_norm == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize("strategy", COUNT_STRATEGIES)
def test_sparse_embedding_is_summarised_as_its_dense_gradient(strategy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Linear(4, 1))
    tokens = torch.tensor([[3, 7, 3, 3, 9]])  # repeated rows: an uncoalesced sparse gradient
    record = one_step(model, lambda m: m(tokens).sum(), strategy)
    assert model[0].weight.grad.is_sparse
    assert_record_matches(record, expected_by_module(model, ["0", "1"]))
    assert record.column("numel")[0] == 200


@PER_LAYER
@pytest.mark.parametrize("strategy", COUNT_STRATEGIES)
def test_injected_nan_and_inf_are_counted_exactly(strategy: str, per_layer: bool) -> None:
    model = mlp()

    def inject(m: nn.Module) -> None:
        m[0].weight.grad.view(-1)[[0, 5, 9]] = float("nan")
        m[2].bias.grad[[1, 2]] = float("inf")
        m[2].weight.grad[0, 0] = -float("inf")
        m[4].weight.grad[0, :2] = float("nan")
        m[4].bias.grad[0] = float("inf")

    record = one_step(model, mlp_loss, strategy, inject, per_layer)
    stats = record.layer_stats()
    assert (stats["0"].nan, stats["0"].inf) == (3, 0)
    assert (stats["2"].nan, stats["2"].inf) == (0, 3)
    assert (stats["4"].nan, stats["4"].inf) == (2, 1)
    assert stats["2"].norm == float("inf")
    assert stats["2"].max_abs == float("inf") if per_layer else math.isnan(stats["2"].max_abs)
    assert_record_matches(record, expected_by_module(model, ["0", "2", "4"]))
    assert record.nan_count == 5 and record.inf_count == 4


def test_parameter_granularity_names_each_parameter() -> None:
    model = mlp()
    record = one_step(model, mlp_loss, granularity="parameter")
    names = [name for name, _ in model.named_parameters()]
    assert record.layers == tuple(names)
    params = dict(model.named_parameters())
    assert_record_matches(record, {n: reference_stats([params[n].grad]) for n in names})


def test_samples_come_uniformly_from_each_tensor_in_turn() -> None:
    grads = [
        torch.arange(0.0, 100.0),  # 30 of 100 drawn
        torch.arange(1000.0, 1003.0),  # 5 asked, 3 elements: all three, once each
        torch.arange(0.0, 100_000.0).reshape(100, 1000) + 1e6,  # 20,000 of 100,000 drawn
    ]
    counts = [30, 5, 20_000]
    generator = torch.Generator().manual_seed(0)
    before = torch.get_rng_state()
    bounds = sample_bounds(grads, counts, torch.device("cpu"))
    samples = sample_elements(grads, counts, generator, bounds).numpy()
    assert torch.equal(torch.get_rng_state(), before)  # gradtrack's own generator only
    first, whole, last = np.split(samples, [30, 33])
    assert samples.dtype == np.float32 and len(last) == 20_000
    assert set(first) <= set(range(100)) and whole.tolist() == [1000.0, 1001.0, 1002.0]
    deciles = np.histogram(last, bins=10, range=(1e6, 1e6 + 100_000))[0]
    assert deciles.sum() == 20_000 and np.all(np.abs(deciles - 2000) < 250)  # ~5.6 sd

    ten = [torch.arange(10.0)]  # 9 of 10 drawn, 30 times: every element, the last included
    bounds = sample_bounds(ten, [9], torch.device("cpu"))
    seen = {v for _ in range(30) for v in sample_elements(ten, [9], generator, bounds).tolist()}
    assert seen == set(range(10))


def test_the_gradients_a_step_hands_the_worker_count_against_the_queues_bytes() -> None:
    """A small CPU step's copy of its gradients waits in the queue with it: `delivery.queue_mib`
    bounds them, the oldest step dropped (and counted) when the next would pass it."""

    def step(n: int) -> PendingStep:
        flat = FlatGrads(torch.zeros(1000), np.array([0]), full=True)  # 4,000 bytes
        return PendingStep(n, 0.0, [HostPart(np.array([0]), None, buffer=None, flat=flat)])

    mailbox = Mailbox(10, "drop_oldest", max_bytes=6000)
    mailbox.put_step(step(0))
    assert mailbox.dropped == 0
    mailbox.put_step(step(1))
    assert mailbox.dropped == 1
    assert [item.step for item in mailbox.take(10, 0.0)] == [1]  # type: ignore[union-attr]
    assert len(mailbox) == 0


def test_the_mailbox_counts_what_ends_a_gathering_behind_a_backlog() -> None:
    """Behind thousands of waiting steps, a take that gathers still returns at once for a step
    whose verdict the training thread waits for, or a control message; once that step is
    taken or dropped, gathering waits again (the counts come and go with the items)."""
    from gradtrack.handoff.mailbox import Control, Reply

    mailbox = Mailbox(5000, "drop_oldest")
    for n in range(4000):
        mailbox.put_step(PendingStep(n, 0.0, []))
    waiting = PendingStep(4000, 0.0, [], reply=Reply())
    mailbox.put_step(waiting)
    start = time.monotonic()
    taken = mailbox.take(10_000, gather_s=5.0)  # (a reply waits: no gathering)
    assert time.monotonic() - start < 2.5 and len(taken) == 4001
    mailbox.put_step(PendingStep(4001, 0.0, []))
    start = time.monotonic()
    assert len(mailbox.take(10, gather_s=0.3)) == 1  # (no reply left: it gathered)
    assert time.monotonic() - start >= 0.25

    small = Mailbox(2, "drop_oldest")
    small.put_step(PendingStep(0, 0.0, [], reply=Reply()))
    small.put_step(PendingStep(1, 0.0, []))
    small.put_step(PendingStep(2, 0.0, []))  # drops step 0, the one with a reply
    start = time.monotonic()
    assert [i.step for i in small.take(10, gather_s=0.3)] == [1, 2]  # type: ignore[union-attr]
    assert time.monotonic() - start >= 0.25

    small.put_step(PendingStep(3, 0.0, []))
    small.put_control(Control("flush"))
    start = time.monotonic()
    assert len(small.take(10, gather_s=5.0)) == 2 and time.monotonic() - start < 2.5
    small.put_step(PendingStep(4, 0.0, []))
    start = time.monotonic()
    assert len(small.take(10, gather_s=0.3)) == 1 and time.monotonic() - start >= 0.25


@pytest.mark.parametrize(
    "values",
    [
        [3.0, 4.0, 1.0, 0.0],  # the unscaled pass
        [3e200, 4e200, 1e-200, 0.0],  # squares overflow, and underflow to 0
        [3e-160, 4e-160, 2.0, 0.0],  # squares subnormal: digits lost unscaled
        [1e150, 2.0, 3.0, 0.0],  # a square just past the unscaled bound
        [3.0, math.nan, 1.0, math.inf],
        [math.inf, math.nan, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    ],
)
def test_layer_norms_from_tensor_norms_keep_every_digit_and_every_nan(
    values: list[float],
) -> None:
    """`root_sum_squares` takes squares of norms unscaled where none over- or underflows,
    else scaled by each group's largest: the same norms either way, NaN and Inf kept."""
    from gradtrack.formats.record import root_sum_squares

    groups = np.array([0, 0, 1, 2])
    got = root_sum_squares(np.array(values), groups, 3)
    for layer, members in enumerate(([0, 1], [2], [3])):
        parts = [values[i] for i in members]
        if any(math.isnan(v) for v in parts):
            assert math.isnan(got[layer])
        else:  # (math.hypot scales: exact where a square would not fit a float)
            assert got[layer] == pytest.approx(math.hypot(*parts), rel=1e-15)


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_every_finite_sample_lands_in_a_bin_whatever_its_range(scale: str) -> None:
    """2,000 sample sets of 72 fp32 values (a small layer's gradient, whole), magnitudes from
    1e-8 to 1e3, plus constant, subnormal and near-maximal sets: every finite value is counted
    in one bin (a log histogram counts the zeros apart), and the edges increase. Rounded, the
    last edge used to fall below the largest value in one histogram in sixteen, which numpy
    then left out."""
    from gradtrack.formats.histogram import bin_samples

    rng = np.random.default_rng(0)
    sets = [
        (rng.standard_normal(72) * 10.0 ** rng.uniform(-8, 3)).astype(np.float32)
        for _ in range(2000)
    ]
    sets += [
        np.full(72, 0.3, np.float32),
        np.array([1e-40, -3e-42, 0.0, 5e-39], np.float32),
        np.array([3e38, -3.4e38, 1.0], np.float32),
    ]
    for values in sets:
        histogram = bin_samples(values, 16, scale)
        assert histogram is not None
        counted = int(histogram.counts.sum()) + (histogram.zeros if scale == "log" else 0)
        assert counted == values.size
        assert np.all(np.diff(histogram.edges) > 0)


def test_tensors_of_few_shapes_gather_by_shape_to_the_same_values_and_norms() -> None:
    """`ShapeGroups` stacks many small tensors per shape: its concatenation is `flatten`'s
    and its squared norms `packed_squares`', to the last bit, whatever order the shapes come
    in (a transposed, non-contiguous tensor among them); with too many shapes it declines."""
    from gradtrack.capture.stats import ShapeGroups, flatten, packed_squares, start_offsets

    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (8,), (3, 5), (1,)] * 16 + [(8, 8)] * 4
    tensors = [
        torch.randn(*shape, generator=generator) * 10.0 ** (i % 7 - 3)
        for i, shape in enumerate(shapes)
    ]
    tensors[5] = torch.randn(8, 8, generator=generator).t()  # (a (8, 8) one, not contiguous)
    groups = ShapeGroups.of(tensors)
    assert groups is not None
    flat = groups.flatten(tensors)
    assert torch.equal(flat, flatten(tensors))
    assert all(flat.data_ptr() != t.data_ptr() for t in tensors)  # (a copy of its own)
    offsets = start_offsets([t.numel() for t in tensors])
    assert groups.squares(tensors).tolist() == packed_squares(tensors, offsets).tolist()
    many = [torch.randn(1, n, generator=generator) for n in range(1, 40)]
    assert ShapeGroups.of(many) is None
