"""The seed's troubleshooting table, reproduced: every classic failure gives the right rule,
at the right step, naming the culprit with the fix that fits; healthy models stay quiet.

All with gradtrack's default configuration (``log_every=10``, default rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.metrics import metric_key, scalar_metrics
from tests.conftest import SmallCNN
from tests.scenarios import models as m
from tests.test_layers import Heads


def one(events: list[AlertEvent]) -> AlertEvent:
    assert len(events) >= 1, "expected an event"
    return events[0]


# -- NaN / Inf ---------------------------------------------------------------------------------
def faulty_blocks(fault: str, at: set[int]) -> tuple[m.Blocks, m.Batch]:
    torch.manual_seed(0)
    model = m.Blocks()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        model.blocks[3].fault = fault if step in at else None
        return m.regression_batch(16)(step)

    return model, batch


def test_nan_made_in_a_blocks_forward_names_that_block() -> None:
    model, batch = faulty_blocks("forward_log", at={13})
    run = m.train(model, batch, m.mse, 15)
    event = one(run.events("nonfinite"))
    assert (event.step, event.origin_stage, event.origin_layer) == (13, "forward", "blocks.3")
    assert event.message.startswith("NaN gradient made in the forward pass at blocks.3's output")
    assert "clamp" in event.message and "eps" in event.message


def test_nan_made_by_an_op_in_a_blocks_backward_names_that_block() -> None:
    model, batch = faulty_blocks("backward_sqrt", at={13})
    run = m.train(model, batch, m.mse, 15)
    event = one(run.events("nonfinite"))
    # Not blocks.2.lin, the first parameterised layer below: the op is blocks.3's own.
    assert (event.step, event.origin_stage, event.origin_layer) == (13, "backward", "blocks.3")
    assert "blocks.3's backward" in event.message and "sqrt" in event.message


def test_after_a_bad_update_the_weights_are_named_non_finite_since_that_step() -> None:
    model, batch = faulty_blocks("backward_sqrt", at={13})
    run = m.train(model, batch, m.mse, 30)
    first, *later = run.events("nonfinite")
    assert (first.step, first.origin_layer) == (13, "blocks.3")
    event = one(later)
    assert (event.step, event.origin_stage) == (20, "weights")  # the next logged step
    assert event.origin_layer == "stem" and "blocks.3.lin" in event.layers
    assert "the weights are non-finite: stem" in event.message
    assert "since step 14: the update of step 13" in event.message
    assert "input batch" not in event.message


def test_nan_from_log_of_zero_in_the_loss_says_eps_or_clamp() -> None:
    torch.manual_seed(0)
    model = m.SaturatingClassifier()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        model.sharp = step == 13
        return m.binary_batch()(step)

    run = m.train(model, batch, m.manual_bce, 15)
    event = one(run.events("nonfinite"))
    assert (event.step, event.origin_stage) == (13, "loss")
    assert "eps or a clamp" in event.message and "binary_cross_entropy_with_logits" in event.message


# -- flow along depth ---------------------------------------------------------------------------
def test_gradual_vanishing_through_eight_sigmoids_trips_flow() -> None:
    torch.manual_seed(0)
    run = m.train(m.sigmoid_mlp(), m.regression_batch(32), m.mse, 30, optimizer="sgd", lr=0.01)
    event = one(run.events("flow"))
    assert (event.step, event.layer, event.severity) == (20, "0", "warning")  # patience 3
    assert event.value < 1e-3 and event.message.startswith("Gradient vanishes along depth")
    for fix in ("ReLU/GELU", "residual", "normalisation", "initialisation"):
        assert fix in event.message
    assert not run.events("jump")  # gradual: no single break


def test_dead_relu_leads_with_the_layer_whose_bias_killed_it() -> None:
    torch.manual_seed(0)
    model = m.relu_mlp(5)
    with torch.no_grad():
        model[6].bias.fill_(-10.0)  # every unit of layer 6 off: 0, 2, 4 and 6 get no gradient
    run = m.train(model, m.regression_batch(32), m.mse, 100)
    event = one(run.events("dead"))
    assert (event.step, event.layer, event.layers) == (90, "6", ("0", "2", "4", "6"))
    assert "The flow stops here: 8" in event.message
    for fix in ("LeakyReLU", "lower learning rate", "bias initialisation"):
        assert fix in event.message


def test_bottleneck_jump_names_the_weak_layer() -> None:
    torch.manual_seed(0)
    run = m.train(m.bottleneck_mlp(), m.regression_batch(32), m.mse, 5)
    event = one(run.events("jump"))
    assert (event.step, event.layer) == (0, "4")  # the scaled layer, not the deeper 7
    assert event.value > 1e5 and "4 is the weak side" in event.message


def test_saturated_tanh_rnn_gets_the_saturation_hint_not_the_relu_one() -> None:
    torch.manual_seed(0)
    run = m.train(m.SaturatedRNN(), m.sequence_batch(), m.mse, 100)
    event = one(run.events("dead"))
    assert (event.step, event.layer) == (90, "rnn")
    assert "saturated tanh/sigmoid" in event.message and "ReLU" not in event.message


def test_layers_one_key_would_merge_keep_their_own_series() -> None:
    torch.manual_seed(0)
    run = m.train(Heads(), m.regression_batch(4), m.mse, 1)
    metrics = scalar_metrics(run.sink.records[0])
    layers = run.watcher.layer_names
    assert layers == ("root-2", "root", "heads.task@a-2", "heads.task_a")
    assert all(metric_key("grad_norm", name) in metrics for name in layers)


# -- healthy controls ---------------------------------------------------------------------------
CONTROLS = {
    "cnn": lambda: m.train(SmallCNN(), m.image_batch(), m.cross_entropy, 150),
    "pre_ln_transformer": lambda: m.train(
        m.PreLNTransformer(), m.token_batch(64), m.next_token_loss, 150
    ),
    "gpt2_tied_embeddings": lambda: m.train(
        m.GPT2Like(), m.token_batch(96), m.next_token_loss, 150, lr=3e-4
    ),
    "bert_post_ln": lambda: m.train(m.BertLike(), m.parity_batch(), m.cross_entropy, 150),
    "lstm": lambda: m.train(m.LSTMRegressor(), m.sequence_batch(), m.mse, 150),
    "hf_gpt2": lambda: m.train(m.hf_gpt2(), m.token_batch(96), m.next_token_loss, 150, lr=3e-4),
    "hf_bert": lambda: m.train(m.hf_bert(), m.parity_batch(), m.cross_entropy, 150, lr=3e-4),
}


@pytest.mark.parametrize("name", list(CONTROLS))
@pytest.mark.slow
def test_healthy_models_raise_no_warning_or_error_in_150_steps(name: str) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    run = CONTROLS[name]()
    assert run.losses[-1] < run.losses[0]  # it trains
    assert [r.step for r in run.sink.records][-1] == 140
    assert run.loud() == []


def test_gpt2_control_ties_its_embedding() -> None:
    model = m.GPT2Like()
    assert model.lm_head.weight is model.wte.weight
    assert isinstance(model.wte, nn.Embedding)


# -- the learning rate (the table's first row: does not converge) ------------------------------
CHANCE = math.log(10)  # ten classes


def collapse_step(losses: list[float]) -> int:
    """The step after the last one at which the run had learnt (a loss below 0.5)."""
    return 1 + max(i for i, loss in enumerate(losses) if loss < 0.5)


def never_advises_a_higher_rate(run: m.Run) -> None:
    for event in run.events():
        assert "higher learning rate" not in event.message, event.message


@pytest.mark.parametrize(
    ("lr", "steps"), [(0.1, 200), (0.05, 150)], ids=["learns_to_0.3", "learns_to_0"]
)
def test_a_collapsing_cnn_is_told_the_learning_rate_within_30_steps(lr: float, steps: int) -> None:
    torch.manual_seed(0)
    run = m.train(
        SmallCNN(), m.prototype_batch(), m.cross_entropy, steps, lr=lr, optimizer="momentum"
    )
    collapse = collapse_step(run.losses)
    # It ends near chance (2.3; it learnt to below 0.5). On the way there a CPU's kernels may
    # let the loss dip back for a step (to 0.78 at step 69 on an AMD EPYC, dead from step 80).
    assert 20 < collapse < steps - 50 and min(run.losses[-50:]) > 1.0
    event = one(run.events("learning_rate"))
    assert event.severity == "warning" and collapse <= event.step <= collapse + 30
    assert "went dead" in event.message and "the learning rate is too high" in event.message
    for fix in ("lower learning rate", "warmup", "clip_grad_norm_"):
        assert fix in event.message
    assert event.value > 0.01 and set(event.layers) <= {"0", "3"}  # the conv layers died
    never_advises_a_higher_rate(run)
    later = [e for e in run.loud() if e.step >= event.step and e.rule != "learning_rate"]
    assert all(f"learning-rate alert of step {event.step}" in e.message for e in later)


@pytest.mark.slow
def test_the_same_cnn_at_a_lower_rate_converges_and_raises_nothing() -> None:
    torch.manual_seed(0)
    run = m.train(
        SmallCNN(), m.prototype_batch(), m.cross_entropy, 300, lr=0.02, optimizer="momentum"
    )
    assert max(run.losses[-100:]) < 0.05  # learnt, and stays learnt
    records = run.sink.records
    assert all(r.update_ratios() is not None for r in records)  # the default measured them
    assert run.loud() == []


@pytest.mark.slow
def test_a_deep_llama_without_warmup_is_told_the_learning_rate() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    run = m.train(m.hf_llama(), m.token_batch(64), m.next_token_loss, 100, lr=1.0,
                  optimizer="adamw")  # fmt: skip
    uniform = math.log(64)
    assert min(abs(loss - uniform) for loss in run.losses[50:]) < 0.05  # uniform predictions
    event = run.loud()[0]
    assert (event.rule, event.step, event.severity) == ("learning_rate", 0, "warning")
    assert "the learning rate is far too high" in event.message and "warmup" in event.message
    assert event.value > 10 and len(event.layers) == 3  # the layers that moved most
    never_advises_a_higher_rate(run)


# -- the learning-rate corpus: collapses of other models and optimizers --------------------------
# Training at a rate this high is chaotic: whether, when and how a run collapses moves with the
# CPU's kernels (AVX-512, AVX2 or none give different runs from the same seed). So the corpus
# holds runs that collapse on some machines, and each run's collapse is found by the test
# itself, from every step's gradients (not gradtrack's records): a layer went dead where its
# gradient norm fell DEAD times below its median of the 50 steps before and stayed there for
# 20 steps while the loss stayed high (above 1, chance is 2.3), or the run diverged (a
# non-finite loss).
DEAD = 1e3


def logged_steps_to(event_step: int, collapse: int, log_every: int = 10) -> int:
    """Which logged step at or after the collapse the event came at: 1 for the first."""
    first_logged = -(-collapse // log_every) * log_every
    return (event_step - first_logged) // log_every + 1


MODELS = {"cnn": SmallCNN, "wide_cnn": m.wide_cnn, "mlp": m.image_mlp, "bn_cnn": m.batchnorm_cnn}


@dataclass
class CorpusRun:
    run: m.Run
    norms: np.ndarray  # [steps, layers]: each step's per-layer gradient norm, measured apart

    def collapse(self, stays: int = 20, before: int = 50) -> int | None:
        """The step at which the run collapsed (a layer went dead, or it diverged), if it did."""
        losses = np.asarray(self.run.losses)
        diverged = np.flatnonzero(~np.isfinite(losses))
        for s in range(before, len(losses) - stays):
            if diverged.size and s >= diverged[0]:
                return int(diverged[0])
            level = np.median(self.norms[s - before : s], axis=0)
            after = self.norms[s : s + stays].max(axis=0)
            dead = (level > 0) & (after <= level / DEAD)
            if dead.any() and losses[s : s + stays].mean() > 1.0:
                return s
        return int(diverged[0]) if diverged.size else None


def corpus_run(model: str, optimizer: str, lr: float, seed: int) -> CorpusRun:
    """250 steps of one corpus model on the ten prototype classes, at the defaults."""
    torch.manual_seed(seed)
    batch = m.prototype_batch()
    net = MODELS[model]()
    owners = [mod for mod in net.modules() if any(True for _ in mod.parameters(recurse=False))]
    squares = np.zeros(len(owners))
    rows: list[np.ndarray] = []

    def add(param: torch.Tensor, i: int) -> None:
        squares[i] += float(param.grad.double().square().sum())  # type: ignore[union-attr]

    for i, owner in enumerate(owners):
        for param in owner.parameters(recurse=False):
            param.register_post_accumulate_grad_hook(lambda p, i=i: add(p, i))

    def before(step: int) -> None:
        if step:
            rows.append(np.sqrt(squares))
            squares[:] = 0.0

    run = m.train(net, batch, m.cross_entropy, 250, lr=lr, optimizer=optimizer, before=before)
    rows.append(np.sqrt(squares))
    return CorpusRun(run, np.stack(rows))


CORPUS = [  # (model, optimizer, lr, seed): each collapses on at least one kind of CPU
    ("cnn", "momentum", 0.03, 0),
    ("cnn", "momentum", 0.05, 1),
    ("cnn", "momentum", 0.05, 2),
    ("cnn", "momentum", 0.07, 0),
    ("cnn", "momentum", 0.07, 1),
    ("cnn", "nesterov", 0.05, 0),
    ("wide_cnn", "momentum", 0.05, 0),
    ("wide_cnn", "momentum", 0.05, 1),
    ("wide_cnn", "momentum", 0.05, 2),
    ("mlp", "momentum", 0.2, 0),  # overflows to NaN
    ("mlp", "momentum", 0.2, 2),
]


@pytest.mark.slow
def test_every_collapse_of_the_corpus_is_told_the_learning_rate_within_two_logged_steps() -> None:
    """Each run that collapses (found apart from gradtrack, see `CorpusRun.collapse`) is told
    "the learning rate is too high" after it had learnt and at most two logged steps after
    its collapse; most of the corpus collapses on any CPU, so the test cannot pass empty."""
    outcomes, failures = [], []
    for case in CORPUS:
        corpus = corpus_run(*case)
        collapse = corpus.collapse()
        if collapse is None:
            outcomes.append(f"{case}: no collapse")
            continue
        losses = corpus.run.losses
        learnt = next((i for i, loss in enumerate(losses) if loss < 0.5), len(losses))
        told = [e for e in corpus.run.events("learning_rate") if learnt <= e.step]
        in_time = [e for e in told if logged_steps_to(e.step, collapse) <= 2]
        outcome = f"{case}: learnt {learnt}, collapsed {collapse}, told {[e.step for e in told]}"
        outcomes.append(outcome)
        if not in_time or not ("the learning rate is" in in_time[0].message
                               and "too high" in in_time[0].message):  # fmt: skip
            failures.append(outcome)
    collapsed = [o for o in outcomes if "no collapse" not in o]
    assert not failures, "\n".join(outcomes)
    assert len(collapsed) >= 6, "\n".join(outcomes)


QUIET = [  # (model, optimizer, lr, seed): each learns and stays learnt
    ("cnn", "adam", 0.003, 0),
    ("cnn", "rmsprop", 0.003, 0),
    ("mlp", "momentum", 0.05, 0),  # fits within 10 steps: every layer's gradient falls 500x
    ("mlp", "momentum", 0.1, 0),
    ("bn_cnn", "adam", 0.03, 0),
    ("wide_cnn", "adam", 0.003, 0),
]


@pytest.mark.parametrize(("model", "optimizer", "lr", "seed"), QUIET)
@pytest.mark.slow
def test_a_model_that_learns_is_never_told_the_learning_rate(
    model: str, optimizer: str, lr: float, seed: int
) -> None:
    run = corpus_run(model, optimizer, lr, seed).run
    assert max(run.losses[-50:]) < 0.5  # learnt, and stays learnt
    assert run.events("learning_rate") == []
