"""Bad input, catalogued: each case stops the sweep stage with one line naming the key or file and what is
allowed, a non-zero exit, and the results of an earlier run left as they were."""

import dataclasses
import http.server
import json
import re
import shutil
import threading
import time
import typing

import pytest
from PIL import Image

from pipeline import data, env, sweep
from pipeline.params import Params
from pipeline.results import WRITTEN
from rcnn.rules import Rule
from tests.conftest import write_tiny_params
from tests.pipeline.helpers import SWEEP_FILES

OUTPUTS = {key: SWEEP_FILES[key] for key in WRITTEN}  # the files the sweep stage writes, by option
# As the sweep writes them
EARLIER = {
    "trials": "trial,status,mlflow_run_id\n0,complete,abc\n",
    "comparisons": "numerator,denominator,phase,ratio\n",
    "kernels": "trial,kind,name,ms\n",
    "modules": "trial,module,backward_ms,flag\n",
    "summary": '{"trials": 1, "complete": 1}\n',
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One data folder and env.json for every case (each case works on its own copy)."""
    folder = tmp_path_factory.mktemp("prepared")
    params = write_tiny_params(folder)
    assert data.main(["--params", str(params), "--out", str(folder / "data")]) == 0
    with (
        pytest.MonkeyPatch.context() as patch
    ):  # every case stops before a trial: the peaks need no measuring
        patch.setattr(env, "ceilings", lambda device: {"matmul_tflops": {"fp32": 1.0}, "copy_gbps": 10.0})
        assert env.main(["--params", str(params), "--out", str(folder / "env.json")]) == 0
    return folder


def first_image(folder):
    return folder / json.loads((folder / "annotations.json").read_text())["images"][0]["file_name"]


def corrupt_annotations(ws):
    (ws["data"] / "annotations.json").write_text('{"images": [')


def missing_image(ws):
    first_image(ws["data"]).unlink()


def truncated_image(ws):
    path = first_image(ws["data"])
    path.write_bytes(path.read_bytes()[:200])


def wrong_size_image(ws):
    path = first_image(ws["data"])
    with Image.open(path) as im:
        im.resize((im.width // 2, im.height // 2)).save(path)


def no_data_folder(ws):
    shutil.rmtree(ws["data"])


def env_without_fingerprint(ws):
    ws["env"].write_text('{"device": "cpu"}')


def unwritable_output(ws):
    (ws["root"] / "a-file").write_text("")
    ws["trials"] = ws["root"] / "a-file" / "trials.csv"  # a folder that cannot be made: even root fails


def join_without_database(ws):
    ws["extra"] = ["--join"]


SECRET = "hunter2-0451-pw"  # a password some cases put in params: no error line may show it

CASES = [  # id, params override, what is done to the files, what the one line must say
    ("wrong-type", {"timing": {"iterations": "5"}}, None, "timing.iterations: expected int, got '5'"),
    ("unknown-key", {"sweep": {"wrokers": 2}}, None, "sweep.wrokers: unknown key; allowed: device"),
    ("empty-grid", {"sweep": {"space": {"head": []}}}, None, "sweep.space.head: expected a non-empty list"),
    (
        "impossible-grid",
        {"sweep": {"space": {"amp": ["fp16"]}}},
        None,
        "sweep.space.amp: no value applies on cpu",
    ),
    ("zero-batch", {"sweep": {"space": {"batch_size": [0]}}}, None, "sweep.space.batch_size: 0 is too small"),
    ("zero-workers", {"sweep": {"workers": 0}}, None, "sweep.workers: 0 is too small; allowed: >= 1"),
    (
        "negative-timeout",
        {"sweep": {"trial_timeout_s": -1}},
        None,
        "sweep.trial_timeout_s: -1.0 is too small",
    ),
    ("zero-rois", {"model": {"rois_per_image": 0}}, None, "model.rois_per_image: 0 is too small"),
    (
        "not-a-spec",
        {"model": {"spec": "resnet18"}},
        None,
        "model.spec: 'resnet18' is not allowed; allowed: a model spec: detector:<head>",
    ),
    (
        "tiny-model-images",
        {"model": {"image_size": 8}},
        None,
        "model.image_size: 8 is too small; allowed: >= 16",
    ),
    ("zero-frames", {"model": {"frames": 0}}, None, "model.frames: 0 is too small; allowed: >= 1"),
    (
        "zero-memory-limit",
        {"sweep": {"memory_limit_mb": 0}},
        None,
        "sweep.memory_limit_mb: 0.0 is too small; allowed: >= 1",
    ),
    (
        "unknown-backbone",
        {"model": {"backbone": "vgg16"}},
        None,
        "model.backbone: 'vgg16' is not allowed; allowed:",
    ),
    (
        "odd-image-size",
        {"model": {"image_size": 100}},
        None,
        "model.image_size: 100 is not allowed; allowed: a multiple of 32",
    ),
    (
        "zero-width-head",
        {"model": {"representation_size": 0}},
        None,
        "model.representation_size: 0 is too small; allowed: >= 1",
    ),
    ("zero-images", {"data": {"num_images": 0}}, None, "data.num_images: 0 is too small; allowed: >= 1"),
    ("tiny-images", {"data": {"image_size": 16}}, None, "data.image_size: 16 is too small; allowed: >= 32"),
    ("zero-classes", {"data": {"num_classes": 0}}, None, "data.num_classes: 0 is too small; allowed: >= 1"),
    ("negative-data-seed", {"data": {"seed": -1}}, None, "data.seed: -1 is too small; allowed: >= 0"),
    (
        "unknown-device",
        {"sweep": {"device": "tpu"}},
        None,
        "sweep.device: 'tpu' is not allowed; allowed: auto, cpu",
    ),
    (
        "unknown-sampler",
        {"sweep": {"sampler": "random"}},
        None,
        "sweep.sampler: 'random' is not allowed; allowed: grid, tpe",
    ),
    ("zero-trials", {"sweep": {"n_trials": 0}}, None, "sweep.n_trials: 0 is too small; allowed: >= 1"),
    ("negative-sweep-seed", {"sweep": {"seed": -1}}, None, "sweep.seed: -1 is too small; allowed: >= 0"),
    (
        "zero-time-budget",
        {"sweep": {"timeout_s": 0}},
        None,
        "sweep.timeout_s: 0.0 is too small; allowed: >= 1",
    ),
    (
        "zero-heartbeat",
        {"sweep": {"heartbeat_s": 0}},
        None,
        "sweep.heartbeat_s: 0 is too small; allowed: >= 1",
    ),
    (
        "negative-profile-steps",
        {"sweep": {"profile_steps": -1}},
        None,
        "sweep.profile_steps: -1 is too small; allowed: >= 0",
    ),
    (
        "zero-pair-seconds",
        {"sweep": {"pair_seconds": 0}},
        None,
        "sweep.pair_seconds: 0.0 is too small; allowed: >= 1",
    ),
    (
        "unknown-profile-amp",
        {"sweep": {"profile_at": [{"amp": "fp8"}]}},
        None,
        "sweep.profile_at.amp: 'fp8' is not allowed; allowed: off, fp16, bf16",
    ),
    (
        "zero-profile-batch",
        {"sweep": {"profile_at": [{"batch_size": 0}]}},
        None,
        "sweep.profile_at.batch_size: 0 is too small; allowed: >= 1",
    ),
    (
        "unknown-head",
        {"sweep": {"space": {"head": ["linear", "mlp"]}}},
        None,
        "sweep.space.head: 'mlp' is not allowed; allowed: linear, conv, conv_as_linear, or "
        "package.module:factory",
    ),
    (
        "unknown-compile",
        {"sweep": {"space": {"compile": ["off", "all"]}}},
        None,
        "sweep.space.compile: 'all' is not allowed; allowed: off, head, model",
    ),
    (
        "unknown-profile-compile",
        {"sweep": {"profile_at": [{"compile": True}]}},
        None,
        "sweep.profile_at.compile: expected str, got True",
    ),
    (
        "profile-compile-value",
        {"sweep": {"profile_at": [{"compile": "max-autotune"}]}},
        None,
        "sweep.profile_at.compile: 'max-autotune' is not allowed; allowed: off, head, model",
    ),
    (
        "tf32-not-a-list",
        {"sweep": {"space": {"tf32": True}}},
        None,
        "sweep.space.tf32: expected a non-empty list",
    ),
    (
        "tf32-as-a-word",
        {"sweep": {"space": {"tf32": ["on"]}}},
        None,
        "sweep.space.tf32: expected bool, got 'on'",
    ),
    (
        "unknown-sweep-key",
        {"sweep": {"allow_tf32": True}},
        None,
        "sweep.allow_tf32: unknown key; allowed: device, sampler",
    ),
    (
        "system-metrics-too-often",
        {"tracking": {"system_metrics_s": 0.1}},
        None,
        "tracking.system_metrics_s: 0.1 is too small; allowed: >= 1",
    ),
    (
        "unknown-amp",
        {"sweep": {"space": {"amp": ["fp8"]}}},
        None,
        "sweep.space.amp: 'fp8' is not allowed; allowed: off, fp16, bf16",
    ),
    ("negative-warmup", {"timing": {"warmup": -1}}, None, "timing.warmup: -1 is too small; allowed: >= 0"),
    (
        "negative-max-warmup",
        {"timing": {"max_warmup": -1}},
        None,
        "timing.max_warmup: -1 is too small; allowed: >= 0",
    ),
    (
        "zero-iterations",
        {"timing": {"iterations": 0}},
        None,
        "timing.iterations: 0 is too small; allowed: >= 1",
    ),
    (
        "zero-max-iterations",
        {"timing": {"max_iterations": 0}},
        None,
        "timing.max_iterations: 0 is too small; allowed: >= 1",
    ),
    (
        "zero-max-seconds",
        {"timing": {"max_seconds": 0}},
        None,
        "timing.max_seconds: 0.0 is too small; allowed: >= 0.001",
    ),
    (
        "zero-precision",
        {"timing": {"rel_precision": 0}},
        None,
        "timing.rel_precision: 0.0 is too small; allowed: >= 0.0001",
    ),
    (
        "unreachable-storage",
        {"sweep": {"storage": "postgresql://rcnn@127.0.0.1:1/none"}},
        None,
        "sweep.storage: cannot open postgresql://rcnn@127.0.0.1:1/none",
    ),
    (
        "unreachable-tracking",
        {"tracking": {"mlflow_uri": "http://127.0.0.1:1"}},
        None,
        "tracking.mlflow_uri: no MLflow server answers at http://127.0.0.1:1",
    ),
    (
        "password-in-storage",
        {"sweep": {"storage": f"postgresql://rcnn:{SECRET}@127.0.0.1:1/none"}},
        None,
        "sweep.storage: the URL holds a password, and params values are recorded in dvc.lock",
    ),
    (
        "password-query-in-storage",
        {"sweep": {"storage": f"postgresql://rcnn@127.0.0.1:1/none?password={SECRET}"}},
        None,
        "sweep.storage: the URL holds a password",
    ),
    (
        "password-in-tracking",
        {"tracking": {"mlflow_uri": f"http://rcnn:{SECRET}@127.0.0.1:1"}},
        None,
        "(and so in git); remove it from the URL and pass it in the environment variables "
        "MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD instead",
    ),
    (
        "password-in-tracking-database",
        {"tracking": {"mlflow_uri": f"postgresql://rcnn:{SECRET}@127.0.0.1:1/mlflow"}},
        None,
        "tracking.mlflow_uri: the URL holds a password",
    ),
    ("join-without-database", {}, join_without_database, "sweep.storage: --join needs a database"),
    ("unwritable-output", {}, unwritable_output, "a-file/trials.csv: cannot write there"),
    ("corrupt-annotations", {}, corrupt_annotations, "annotations.json: not COCO format"),
    ("missing-image", {}, missing_image, ".png: cannot read image"),
    ("truncated-image", {}, truncated_image, ".png: cannot read image"),
    ("wrong-size-image", {}, wrong_size_image, "annotations.json says 64x64"),
    ("no-data-folder", {}, no_data_folder, "data: data folder does not exist"),
    ("env-without-fingerprint", {}, env_without_fingerprint, "env.json: needs 'fingerprint' and 'ceilings'"),
]


@pytest.mark.parametrize("override, damage, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_stops_with_one_line_and_keeps_earlier_results(
    tmp_path, tiny_params, prepared, capsys, override, damage, message
):
    ws = {"root": tmp_path, "data": tmp_path / "data", "env": tmp_path / "env.json", "extra": []}
    shutil.copytree(prepared / "data", ws["data"])
    shutil.copy(prepared / "env.json", ws["env"])
    earlier = {}
    for key, name in OUTPUTS.items():  # an earlier run's results
        ws[key] = tmp_path / name
        ws[key].write_text(EARLIER[key])
        earlier[ws[key]] = ws[key].read_text()
    if damage:
        damage(ws)
    argv = [
        "--params",
        str(tiny_params(override)),
        "--data",
        str(ws["data"]),
        "--env",
        str(ws["env"]),
        *[a for key in OUTPUTS for a in (f"--{key}", str(ws[key]))],
        *ws["extra"],
    ]
    capsys.readouterr()

    code = sweep.main(argv)

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert SECRET not in err
    assert {path: path.read_text() for path in earlier} == earlier


def checked_keys(cls: type = Params, prefix: str = "") -> dict[str, Rule]:
    """Every params key whose values a Rule checks, as pipeline/params.py declares it (the field's
    metadata)."""
    keys = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        # sweep.profile_at: a tuple
        nested = [t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)]
        if nested:
            keys |= checked_keys(nested[0], key + ".")
        elif f.metadata.get("rule") is not None:
            keys[key] = f.metadata["rule"]
    return keys


def overridden(override: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(key, value) for every value a case's override sets; a list of mappings (sweep.profile_at) sets
    theirs."""
    out = []
    for name, value in override.items():
        if isinstance(value, dict):
            out += overridden(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out += [pair for v in value for pair in overridden(v, f"{prefix}{name}.")]
        else:
            out.append((prefix + name, value))
    return out


def refuses(rule: Rule, value: object) -> bool:
    try:
        return any(rule.problem(v) for v in (value if isinstance(value, list) else [value]))
    except TypeError:  # a value of the wrong type ('5' for an int): the type check's case, not the rule's
        return False


def test_every_checked_params_key_has_a_case_its_rule_refuses():
    rules = checked_keys()
    tried = [(key, value) for _, override, _, _ in CASES for key, value in overridden(override)]
    missing = [key for key, rule in rules.items() if not any(k == key and refuses(rule, v) for k, v in tried)]
    assert not missing, f"no bad-input case gives these keys a value their rule refuses: {', '.join(missing)}"
    # And the other way: every case worded as a rule's refusal is about a key the introspection found.
    worded = {m.split(":")[0] for *_, m in CASES if re.match(r"[\w.]+: .* is (too small|not allowed)", m)}
    assert worded <= set(rules), worded - set(rules)


class AuthenticatingServer(http.server.BaseHTTPRequestHandler):
    """An MLflow server with authentication on, as the sweep stage meets it: /health answers anyone (as
    MLflow's does), every other request gets 401 (a stand-in: MLflow's own is started in test_scale_out)."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 401)
        self.end_headers()
        self.wfile.write(b"OK" if self.path == "/health" else b"You are not authenticated.")

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def authenticating_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AuthenticatingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize(
    "user, sent", [(None, "a request without credentials"), ("sweep", "the credentials of user sweep")]
)
def test_a_tracking_server_refusing_the_credentials_stops_the_sweep_at_once(
    tmp_path, tiny_params, prepared, capsys, monkeypatch, authenticating_server, user, sent
):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    if user:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    params = tiny_params({"tracking": {"mlflow_uri": authenticating_server}})
    argv = [
        "--params",
        str(params),
        "--data",
        str(prepared / "data"),
        "--env",
        str(prepared / "env.json"),
        *[a for key, name in OUTPUTS.items() for a in (f"--{key}", str(tmp_path / name))],
    ]
    capsys.readouterr()
    started = time.monotonic()

    code = sweep.main(argv)

    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and SECRET not in err, err
    assert err == (
        f"error: tracking.mlflow_uri: the MLflow server at {authenticating_server} refused {sent} "
        "(HTTP 401); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user of that server\n"
    )
    assert time.monotonic() - started < 30  # no MLflow retries
    journal = tmp_path / "optuna.journal"
    # No study made
    assert not (journal.exists() and journal.read_bytes()) and not (tmp_path / "trials.csv").exists()
