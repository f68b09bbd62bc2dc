"""A contract test for every private API gradtrack uses, each as gradtrack uses it: a release
of torch, mlflow or wandb that renames or changes one fails here, by name, instead of
breaking watching silently. Where a public replacement exists gradtrack uses it instead
(``GradScaler.get_backoff_factor``, ``inspect.currentframe``, ``wandb.Run``, the REST
API's documented JSON for ``log-batch``), and the test pins it to what
the private path did.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn


def test_torch_foreach_ops_take_lists_and_keep_their_signatures() -> None:
    """stats.py, updates.py, origin.py: one batched kernel per list."""
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([-1.0, float("nan")])]
    l2 = torch._foreach_norm(grads, 2, dtype=torch.float64)
    assert l2[0].dtype == torch.float64 and float(l2[0]) == 5.0
    assert float(torch._foreach_norm(grads, 1, dtype=torch.float64)[0]) == 7.0
    assert float(torch._foreach_norm(grads, float("inf"))[0]) == 4.0
    # The NaN/Inf count: x - x is NaN exactly where x is non-finite; norm 0 counts non-zeros.
    nonfinite = torch._foreach_norm(torch._foreach_sub(grads, grads), 0, dtype=torch.float64)
    assert [float(n) for n in nonfinite] == [0.0, 1.0]
    clamped = torch._foreach_clamp_max(torch._foreach_clamp_min(grads, -1.0), 1.0)
    assert clamped[0].tolist() == [1.0, 1.0]
    copies = [torch.zeros(2), torch.zeros(2)]
    torch._foreach_copy_(copies, grads)
    torch._foreach_sub_(copies, grads)
    assert copies[0].tolist() == [0.0, 0.0]


def test_torch_flatten_dense_tensors_concatenates_in_one_call() -> None:
    """stats.py: many small gradients packed end to end (one tensor alone: a view of it,
    which every caller copies before working in place)."""
    from torch._utils import _flatten_dense_tensors

    grads = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([5.0]), torch.zeros(0)]
    assert _flatten_dense_tensors(grads).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    alone = torch.tensor([[1.0], [2.0]])
    assert _flatten_dense_tensors([alone]).data_ptr() == alone.data_ptr()


def test_torch_pytree_leaves() -> None:
    from torch.utils._pytree import tree_leaves  # origin.py: tensors in any output

    leaves = tree_leaves({"a": [torch.ones(1), (2, torch.zeros(1))], "b": None})
    assert [type(leaf) for leaf in leaves].count(torch.Tensor) == 2


def test_torch_graph_task_id_and_queued_callbacks_end_a_backward() -> None:
    """probes.py: a step ends in a callback queued on the running backward (once per graph
    task, told apart by its id); the callback runs after every gradient is accumulated."""
    assert torch._C._current_graph_task_id() == -1  # outside a backward
    layer = nn.Linear(3, 2)
    seen: list[int] = []
    ended: list[bool] = []

    def ready(param: torch.Tensor) -> None:
        seen.append(torch._C._current_graph_task_id())
        if len(seen) == 1:
            done = lambda: ended.append(all(p.grad is not None for p in layer.parameters()))  # noqa: E731
            torch.autograd.Variable._execution_engine.queue_callback(done)

    for param in layer.parameters():
        param.register_post_accumulate_grad_hook(ready)
    layer(torch.randn(4, 3)).sum().backward()
    assert len(seen) == 2 and seen[0] == seen[1] >= 0
    assert ended == [True]
    layer(torch.randn(4, 3)).sum().backward()
    assert seen[2] != seen[0]  # a new graph task


def test_gradscaler_scale_and_per_optimizer_state() -> None:
    """probes.py `ScalerTap`: the scale as a device tensor (get_scale() would read it on the
    host) and each optimizer's found-inf flags, without a sync."""
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(layer(torch.randn(3, 2)).sum()).backward()
    scaler.step(optimizer)
    assert isinstance(scaler._scale, torch.Tensor) and float(scaler._scale) == 8.0
    states = list(scaler._per_optimizer_states.values())
    flags = [f for state in states for f in state["found_inf_per_device"].values()]
    assert flags and all(isinstance(f, torch.Tensor) for f in flags)
    assert scaler.get_backoff_factor() == 0.5
    scaler.update()


def test_mlflow_active_run_stack_holds_this_threads_runs(tmp_path: Path) -> None:
    """sinks/mlflow_tracking.py `MlflowRun.end_shared`: a shared run is taken off the
    thread's stack of active runs without end_run (which would mark it ended)."""
    import mlflow
    from mlflow.tracking import fluent

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    try:  # (its own experiment: an earlier test may have left one active in MLflow's globals)
        experiment = mlflow.MlflowClient(uri).create_experiment("contract")
        with mlflow.start_run(experiment_id=experiment) as run:
            stack = fluent._active_run_stack.get()
            assert isinstance(stack, list) and stack[-1].info.run_id == run.info.run_id
            stack.pop()
            assert mlflow.active_run() is None
    finally:
        mlflow.set_tracking_uri(None)


def test_mlflow_rest_helpers_take_what_gradtrack_passes() -> None:
    """sinks/mlflow_tracking.py `RestTracking`: one attempt per call, with a timeout."""
    from mlflow.tracking._tracking_service.utils import get_default_host_creds
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    creds = get_default_host_creds("http://127.0.0.1:9")
    assert creds.host == "http://127.0.0.1:9"
    parameters = inspect.signature(http_request).parameters
    for name in ("host_creds", "endpoint", "method", "max_retries", "backoff_factor", "timeout"):
        assert name in parameters, name
    assert list(inspect.signature(verify_rest_response).parameters)[:2] == ["response", "endpoint"]


def test_mlflow_log_batch_body_is_what_mlflows_own_client_sends() -> None:
    """sinks/mlflow_tracking.py `log_batch_body`: the REST API's ``log-batch`` JSON, written by
    gradtrack instead of through MLflow's protobuf helpers (``mlflow.protos.service_pb2``,
    ``mlflow.utils.proto_json_utils``); it must stay what they write, NaN and ±Inf included."""
    import json

    from mlflow.entities import Metric, RunTag
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.proto_json_utils import message_to_json

    from gradtrack.sinks.mlflow_tracking import log_batch_body

    nonfinite = [
        ("n", float("nan"), 1, 2),
        ("i", float("inf"), 1, 2**40),
        ("m", -float("inf"), 0, 0),
    ]
    finite = [
        ("a", 1.5, 1_700_000_000_000, 0),
        ("t", 1e-40, 5, 5),
        ("z", 0.0, 0, 0),
        ("k", 3, 1, 1),
    ]
    for metrics, tags in (
        (nonfinite + finite, [("gradtrack.alert.count", "2"), ("empty", "")]),
        ([], [("gradtrack.weakest_layer", "fc")]),
        (finite, []),
    ):
        proto = LogBatch(
            run_id="abc",
            metrics=[Metric(k, v, t, s).to_proto() for k, v, t, s in metrics],
            tags=[RunTag(k, v).to_proto() for k, v in tags],
        )
        ours = log_batch_body("abc", metrics, tags)
        assert json.dumps(ours) == json.dumps(json.loads(message_to_json(proto)))


def test_wandb_alert_levels_and_run_class_are_public() -> None:
    """sinks/wandb.py: run.alert's level strings are the values of the public
    ``wandb.AlertLevel`` (wandb's type stubs do not export it), the run is typed as the public
    ``wandb.Run``; formats/wandb.py reads the offline file's protobuf records."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    assert {level.value for level in wandb.AlertLevel} >= {"INFO", "WARN", "ERROR"}
    assert "level" in inspect.signature(wandb.Run.alert).parameters
    fields = wandb_internal_pb2.Record.DESCRIPTOR.fields_by_name
    assert {"history", "alert", "summary", "exit", "run", "config"} <= set(fields)


@pytest.mark.slow
def test_wandb_transaction_log_framing_reads_as_wandbs_own_inspector_reads_it(
    tmp_path: Path,
) -> None:
    """formats/wandb.py `iter_records` parses the ``.wandb`` file's framing by hand (W&B has no
    public reader): every record of a real offline run, one larger than a 32 KiB block
    included, must come out as W&B's own inspector (``wandb leet inspect``) reads them."""
    import json

    from gradtrack.formats.wandb import find_run_file, iter_records
    from tests.sinks.wandb_records import read_records, run_dirs, run_python

    code = (
        "import wandb\n"
        "run = wandb.init(mode='offline', dir='.', project='contract', config={'a': 1})\n"
        "for i in range(3):\n"
        "    run.log({'x': float(i), 'big': 'y' * 40000 if i == 1 else 's'})\n"
        "run.alert(title='t', text='step 1: boom', level=wandb.AlertLevel.WARN)\n"
        "run.finish()\n"
    )
    done = run_python(code, tmp_path, timeout_s=120)
    assert done.returncode == 0, done.stderr
    (run_dir,) = run_dirs(tmp_path)
    ours = list(iter_records(find_run_file(run_dir)))
    theirs = read_records(run_dir)
    assert [r.WhichOneof("record_type") for r in ours] == [r["type"] for r in theirs]
    rows = [
        {
            ".".join(item.nested_key) or item.key: json.loads(item.value_json)
            for item in r.history.item
        }
        for r in ours
        if r.WhichOneof("record_type") == "history"
    ]
    assert [row["x"] for row in rows] == [0.0, 1.0, 2.0] and len(rows[1]["big"]) == 40000
    assert [r.alert.text for r in ours if r.WhichOneof("record_type") == "alert"] == [
        "step 1: boom"
    ]


def test_a_compiled_module_holds_the_model_as_orig_mod() -> None:
    """capture/layers.py: a torch.compile'd model's layers are named from the model inside."""
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)  # nothing compiles before its first call
    assert type(compiled).__name__ == "OptimizedModule" and compiled._orig_mod is model


@pytest.mark.slow
def test_mlflow_clients_sql_store_has_an_engine_to_dispose(tmp_path: Path) -> None:
    """sinks/mlflow_tracking.py `ClientTracking.close` frees the embedded store's connection
    pool through ``MlflowClient._tracking_client.store.engine``, read by name with getattr (no
    public close exists): if that path moves, the pool stays open and this fails."""
    from gradtrack.sinks.mlflow_tracking import ClientTracking

    tracking = ClientTracking(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracking.experiment_id("contract")  # the store opens connections
    engine = tracking.client._tracking_client.store.engine
    assert callable(engine.dispose) and engine.pool.checkedin() > 0
    tracking.close()
    assert engine.pool.checkedin() == 0


def test_deepspeed_links_parameters_to_their_zero_optimizer() -> None:
    """capture/zero.py: ZeRO-3 sets ``_z3_optimizer`` on each parameter, stages 1-2
    ``_zero_optimizer`` (offloading) and ``_hp_mapping`` (its piece of the fp32 weights)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    assert "p._z3_optimizer = self" in inspect.getsource(stage3)
    source = inspect.getsource(stage_1_and_2)
    assert "._zero_optimizer = self" in source and "._hp_mapping = " in source


def test_no_other_private_api_is_used() -> None:
    """The list above is complete for gradtrack's own code: a new private call fails here
    until it has a contract test (tests may reach further: they are not shipped)."""
    import re

    allowed = {
        "torch._foreach_norm", "torch._foreach_sub", "torch._foreach_clamp_max",
        "torch._foreach_clamp_min", "torch._foreach_copy_", "torch._foreach_sub_",
        "torch._C._current_graph_task_id", "torch.autograd.Variable._execution_engine",
        "torch.utils._pytree", "torch._utils._flatten_dense_tensors", "scaler._scale",
        "scaler._per_optimizer_states",
        "fluent._active_run_stack", "mlflow.tracking._tracking_service",
    }  # fmt: skip
    pattern = re.compile(r"\b(?:torch|mlflow|wandb|scaler|fluent|sys|threading)(?:\.\w+)*\._\w+")
    root = Path(__file__).resolve().parents[1] / "gradtrack"
    found = {
        match.group(0)
        for path in root.rglob("*.py")
        for match in pattern.finditer(path.read_text())
    }
    unknown = sorted(f for f in found if not any(f.startswith(a) for a in allowed))
    assert unknown == []
    # Private attributes read by name (getattr/hasattr with a string), each tested above.
    by_name = re.compile(r"\b(?:getattr|hasattr)\([^\n]*?,\s*\"(_\w+)\"")
    named = {
        match.group(1)
        for path in root.rglob("*.py")
        for match in by_name.finditer(path.read_text())
    }
    tested = {"_orig_mod", "_tracking_client", "_z3_optimizer", "_zero_optimizer", "_hp_mapping"}
    assert named == tested
