"""Configuration: every source, the precedence between them, and errors that say what to fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.config import GradtrackConfig, load_config
from gradtrack.errors import GradtrackConfigError
from gradtrack.sinks.memory import MemorySink
from tests.conftest import Told


def test_defaults() -> None:
    config = load_config(environ={})
    assert (config.log_every, config.histograms.every, config.histograms.bins) == (10, 100, 64)
    assert config.delivery.queue_full == "drop_oldest" and config.granularity == "layer"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.toml", 'log_every = 3\ninclude = ["enc*"]\nmodule_types = ["Linear"]\n'),
        ("c.yaml", "log_every: 3\ninclude: [enc*]\nmodule_types: [Linear]\n"),
        ("c.json", '{"log_every": 3, "include": ["enc*"], "module_types": ["Linear"]}'),
    ],
)
def test_config_files(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    config = load_config(path, environ={})
    assert config.log_every == 3 and config.include == ("enc*",)
    assert config.module_types == (nn.Linear,)


def test_precedence_file_env_config_overrides(tmp_path: Path) -> None:
    path = tmp_path / "gradtrack.toml"
    path.write_text("log_every = 2\n[histograms]\nevery = 7\nbins = 9\nseed = 5\n")
    environ = {
        "GRADTRACK_CONFIG": str(path),
        "GRADTRACK_HISTOGRAMS__EVERY": "11",
        "GRADTRACK_HISTOGRAMS__BINS": "13",
    }
    config = load_config(
        {"histograms": {"bins": 17, "seed": 6}}, {"histograms": {"seed": 8}}, environ=environ
    )
    assert config.log_every == 2  # file
    assert config.histograms.every == 11  # env beats file
    assert config.histograms.bins == 17  # config= beats env
    assert config.histograms.seed == 8  # keyword override beats everything


def test_environment_values_are_parsed() -> None:
    environ = {
        "GRADTRACK_HISTOGRAMS__EVERY": "none",
        "GRADTRACK_EXCLUDE": "head.*, *.bias",
        "GRADTRACK_MODULE_TYPES": "Linear,torch.nn.Conv2d",
        "GRADTRACK_DELIVERY__QUEUE_FULL": "block",
        "OTHER_LOG_EVERY": "x",
    }
    config = load_config(environ=environ)
    assert config.histograms.every is None and config.exclude == ("head.*", "*.bias")
    assert config.module_types == (nn.Linear, nn.Conv2d) and config.delivery.queue_full == "block"


def test_config_round_trips_through_json() -> None:
    config = GradtrackConfig(module_types=["Linear"], alerts={"spike": {"ratio": 3}}, log_every=2)
    dumped = config.model_dump(mode="json")  # what the W&B sink stores in the run config
    assert dumped["module_types"] == ["torch.nn.modules.linear.Linear"]
    assert GradtrackConfig(**dumped) == config


def test_a_config_object_only_contributes_what_was_set() -> None:
    environ = {"GRADTRACK_HISTOGRAMS__BINS": "8"}
    config = load_config(GradtrackConfig(log_every=4), environ=environ)
    assert (config.log_every, config.histograms.bins) == (4, 8)


def test_misspelt_field_names_the_field_and_suggests_the_right_one() -> None:
    with pytest.raises(GradtrackConfigError) as error:
        load_config(overrides={"log_evry": 5}, environ={})
    message = str(error.value)
    assert "unknown field 'log_evry'" in message and "did you mean 'log_every'" in message
    assert "keyword argument" in message


def test_misspelt_environment_variable_is_named() -> None:
    with pytest.raises(GradtrackConfigError, match="GRADTRACK_LOGEVERY"):
        load_config(environ={"GRADTRACK_LOGEVERY": "5"})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"log_every": 0}, r"log_every = 0 .*greater than 0"),
        (
            {"delivery": {"queue_full": "wait"}},
            r"delivery.queue_full = 'wait' .*'drop_oldest' or 'block'",
        ),
        ({"granularity": "module"}, r"granularity = 'module' .*'layer' or 'parameter'"),
        ({"module_types": ["Linaer"]}, r"no module type 'Linaer'.*Linear"),
        ({"module_types": [int]}, r"module_types.0 = <class 'int'> .*subclass of Module"),
        ({"histograms": {"bins": 1}}, r"histograms.bins = 1 .*greater than or equal to 2"),
        # Infinite or absurd times would hang close() or kill the worker: refused up front.
        ({"flush_timeout_s": float("inf")}, r"flush_timeout_s = inf .*finite number"),
        ({"delivery": {"batch_wait_s": float("inf")}}, r"batch_wait_s = inf .*finite number"),
        ({"delivery": {"batch_wait_s": 120}}, r"batch_wait_s = 120 .*less than or equal to 60"),
        ({"flush_timeout_s": 1e9}, r"flush_timeout_s = 1000000000.0 .*less than or equal to 3600"),
        ({"mlflow": {"request_timeout_s": float("nan")}}, r"request_timeout_s = nan .*finite"),
        ({"mlflow": {"retry_max_s": 1e6}}, r"mlflow.retry_max_s .*less than or equal to 3600"),
        (
            {"histograms": {"seed": 2**70}},
            r"seed = 1180591620717411303424 .*less than 9223372036854775808",
        ),
        ({"histograms": {"seed": -1}}, r"seed = -1 .*greater than or equal to 0"),
    ],
)
def test_invalid_values_name_field_value_and_what_is_allowed(
    overrides: dict[str, object], expected: str
) -> None:
    with pytest.raises(GradtrackConfigError, match=expected):
        load_config(overrides=overrides, environ={})


def test_watch_raises_config_errors_before_touching_the_model() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(GradtrackConfigError, match="log_every"):
        gradtrack.watch(model, log_every=0)
    gradtrack.watch(model, backend="memory").close()  # nothing was left registered


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bad.toml", "log_every = = 3"),
        ("bad.yaml", "log_every: [3"),
        ("bad.json", "{log_every: 3}"),
    ],
)
def test_a_config_file_that_does_not_parse(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(GradtrackConfigError, match=f"cannot parse gradtrack config file .*{name}"):
        load_config(path, environ={})


def test_config_file_problems(tmp_path: Path) -> None:
    with pytest.raises(GradtrackConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", environ={})
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(GradtrackConfigError, match=r"must end in \.toml"):
        load_config(tmp_path / "c.ini", environ={})
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(GradtrackConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml", environ={})
    (tmp_path / "typo.toml").write_text("hist_evry = 3\n")
    with pytest.raises(GradtrackConfigError, match=r"hist_evry.*from file .*typo.toml"):
        load_config(tmp_path / "typo.toml", environ={})


def test_layer_metrics_choose_the_per_layer_keys_and_name_the_allowed_values() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    with gradtrack.watch(model, "memory", log_every=1, layer_metrics=["norm", "rms"]) as watcher:
        model(torch.randn(2, 3)).sum().backward()
    sink = watcher.sinks[0]
    assert isinstance(sink, MemorySink)
    per_layer = {key.split("/")[0] for key in sink.scalars() if not key.startswith("grad/")}
    assert per_layer == {"grad_norm", "grad_rms"}
    assert sink.records[0].column("max_abs").all()  # still computed, just not written

    with pytest.raises(GradtrackConfigError, match="'norm', 'max_abs', 'mean_abs' or 'rms'"):
        gradtrack.watch(model, "memory", layer_metrics="median")


def test_a_worker_that_dies_mocked_says_why_and_training_and_close_go_on(told: Told) -> None:
    """Mocked: no real input kills the worker thread any more, so its mailbox is broken."""
    model = nn.Linear(3, 1)
    watcher = gradtrack.watch(
        model, backend=MemorySink(), log_every=1, delivery={"queue_full": "block"}
    )

    def broken_take(*_: object) -> None:
        raise SystemError("worker bug")

    # The thread waits inside the real take(); once a step wakes it, its next call breaks.
    watcher.mailbox.take = broken_take  # type: ignore[method-assign]
    model(torch.randn(2, 3)).sum().backward()
    watcher.worker._thread.join(30)
    assert told.count("worker thread stopped: SystemError") == 1
    assert not watcher.worker._thread.is_alive()
    for _ in range(100):  # queue_full="block" would wait forever for a worker that is gone
        model(torch.randn(2, 3)).sum().backward()
    watcher.close()  # returns
    assert watcher.dropped_steps >= 100


@pytest.mark.parametrize(
    ("overrides", "field", "suggestion", "section_field"),
    [
        ({"alerts": {"exploding": {"treshold": 5}}}, "alerts.exploding.treshold",
         "alerts.exploding.threshold", "cooldown_steps"),
        ({"mlflow": {"experiment_name": "x"}}, "mlflow.experiment_name",
         "mlflow.experiment", "tracking_uri"),
        ({"histograms": {"bnis": 8}}, "histograms.bnis", "histograms.bins", "sample_size"),
        ({"delivery": {"queue_sise": 8}}, "delivery.queue_sise", "delivery.queue_size",
         "batch_wait_s"),
        ({"spool": {"mb": 8}}, "spool.mb", "spool.mib", "dir"),
        ({"console": {"interval": 1}}, "console.interval", "console.interval_s", "interval_s"),
    ],
)  # fmt: skip
def test_a_nested_typo_lists_its_sections_fields_and_suggests_the_closest(
    overrides: dict[str, object], field: str, suggestion: str, section_field: str
) -> None:
    with pytest.raises(GradtrackConfigError) as error:
        load_config(overrides=overrides, environ={})
    message = str(error.value)
    assert f"unknown field {field!r}" in message and f"did you mean {suggestion!r}" in message
    known = message.split("Known fields of ")[1]
    assert section_field in known and "log_every" not in known  # not the 30 top-level ones


def test_a_flat_name_of_a_development_build_is_an_unknown_field() -> None:
    """Nothing was released before the sections: no old name is carried."""
    with pytest.raises(GradtrackConfigError, match=r"unknown field 'hist_bins'") as error:
        load_config(overrides={"hist_bins": 8}, environ={})
    assert "Known fields: " in str(error.value) and "histograms" in str(error.value)


def test_environment_variables_reach_the_sections() -> None:
    environ = {
        "GRADTRACK_HISTOGRAMS__SCALE": "log",
        "GRADTRACK_HISTOGRAMS__SEED": "4",
        "GRADTRACK_DELIVERY__QUEUE_SIZE": "5",
        "GRADTRACK_DELIVERY__BATCH_WAIT_S": "0.25",
        "GRADTRACK_SPOOL__MIB": "9",
        "GRADTRACK_CONSOLE__INTERVAL_S": "0.5",
        "GRADTRACK_UPDATE_SIGNALS": "1",
        "GRADTRACK_SPOOL_DIR": "/tmp/spools",  # as before: the spool's folder, no warning
    }
    config = load_config(environ=environ)
    assert (config.histograms.scale, config.histograms.seed) == ("log", 4)
    assert (config.delivery.queue_size, config.delivery.batch_wait_s) == (5, 0.25)
    assert (config.spool.mib, config.spool.dir, config.console.interval_s) == (
        9, Path("/tmp/spools"), 0.5,
    )  # fmt: skip
    assert config.update_signals is True


def test_switches_stand_for_their_sections() -> None:
    environ = {"GRADTRACK_SPOOL": "off", "GRADTRACK_HISTOGRAMS": "0"}
    config = load_config(environ=environ)
    assert not config.spool.enabled and config.histograms.every is None
    config = load_config(
        {"spool": False, "histograms": False}, {"spool": {"mib": 5}, "update_signals": True},
        environ={},
    )  # fmt: skip
    assert (config.spool.enabled, config.spool.mib, config.histograms.every) == (False, 5, None)
    dumped = config.model_dump(mode="json")
    assert dumped["update_signals"] is True and GradtrackConfig(**dumped) == config
    with pytest.raises(GradtrackConfigError, match="GRADTRACK_SPOOL='maybe' is not a switch"):
        load_config(environ={"GRADTRACK_SPOOL": "maybe"})
    environ = {"GRADTRACK_NOISE_SCALE": "off", "GRADTRACK_FLIGHT": "no"}
    config = load_config(environ=environ)
    assert not config.noise_scale.enabled and not config.flight.enabled
    config = load_config({"noise_scale": False, "flight": False}, environ={})
    assert not config.noise_scale.enabled and not config.flight.enabled
    assert load_config({"noise_scale": True}, environ={}).noise_scale.enabled


def test_environment_spellings_pydantic_settings_does_not_have() -> None:
    """The switch and its section's variables merge; 'none', 'null' and '' are None (a switch's
    '' is off); lists are comma-separated anywhere; sections and mappings also take JSON."""
    environ = {
        "GRADTRACK_SPOOL": "0",
        "GRADTRACK_SPOOL__MIB": "5",
        "GRADTRACK_DISABLED": "",
        "GRADTRACK_MODEL_NAME": " NULL ",
        "GRADTRACK_HISTOGRAMS__EVERY": "",
        "GRADTRACK_LAYER_METRICS": "norm, rms",
        "GRADTRACK_WANDB__TAGS": "a,b",
        "GRADTRACK_ALERTS__LAYERS": '{"head.*": {"dead": {"patience": 50}}}',
    }
    config = load_config(environ=environ)
    assert (config.spool.enabled, config.spool.mib, config.enabled) == (False, 5, True)
    assert config.model_name is None and config.histograms.every is None
    assert config.layer_metrics == ("norm", "rms") and config.wandb.tags == ("a", "b")
    assert config.alerts.for_layer("dead", "head.0").patience == 50
    with pytest.raises(GradtrackConfigError, match=r"include = None \(from GRADTRACK_INCLUDE\)"):
        load_config(environ={"GRADTRACK_INCLUDE": "none"})
    with pytest.raises(GradtrackConfigError, match=r"GRADTRACK_ALERTS='\{bad' is not JSON"):
        load_config(environ={"GRADTRACK_ALERTS": "{bad"})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("GRADTRACK_FOO__BAR", r"unknown field 'foo__bar' \(from GRADTRACK_FOO__BAR\)"),
        ("GRADTRACK_LOG_EVERY__X", r"'log_every__x' \(from GRADTRACK_LOG_EVERY__X\); did you"),
    ],
)
def test_a_variable_no_field_reads_is_named(name: str, expected: str) -> None:
    with pytest.raises(GradtrackConfigError, match=expected):
        load_config(environ={name: "5"})


def test_a_config_files_keys_are_field_names_as_written(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"Log_Every": 2}')
    with pytest.raises(GradtrackConfigError, match="unknown field 'Log_Every'"):
        load_config(tmp_path / "c.json", environ={})
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml", environ={}) == load_config(environ={})


@pytest.mark.slow  # a fresh interpreter, without PyYAML
def test_a_yaml_file_without_pyyaml_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("log_every: 3\n")
    code = (
        "import sys; sys.modules['yaml'] = None\n"  # as if PyYAML were not installed
        "from gradtrack.config import load_config\n"
        "load_config(sys.argv[1], environ={})\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADTRACK_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "c.yaml is YAML but PyYAML is not installed: pip install pyyaml" in done.stderr
