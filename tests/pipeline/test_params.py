import pytest

from pipeline.params import Params, ParamsError, load_params, parse_params
from rcnn import bench
from rcnn.measure.stats import TimingPolicy
from tests.conftest import ROOT


def test_repo_params_load_and_freeze():
    params = load_params(ROOT / "params.yaml")
    assert params.sweep.space.head == ("linear", "conv", "conv_as_linear")
    assert params.sweep.n_trials is None and params.timing.iterations >= 1
    with pytest.raises(AttributeError):
        params.sweep.device = "cuda"


def test_missing_keys_take_defaults():
    assert parse_params({}) == Params()


def test_the_repo_params_state_the_timing_defaults():
    """params.yaml's timing section is the library's defaults (rcnn.measure.stats.TimingPolicy), not a fifth
    set."""
    assert load_params(ROOT / "params.yaml").timing.policy() == TimingPolicy()


def test_values_read_as_dvc_writes_them_back(tmp_path):
    """dvc exp run -S rewrites params.yaml in YAML 1.2: `off` unquoted is a string there, `1e-3` a float."""
    path = tmp_path / "params.yaml"
    path.write_text(
        "sweep:\n  space: {amp: [off, bf16]}\n  profile_at: [{amp: off}]\ntiming: {rel_precision: 1e-3}\n"
    )
    params = load_params(path)
    assert params.sweep.space.amp == ("off", "bf16") and params.sweep.profile_at[0].amp == "off"
    assert params.timing.rel_precision == 0.001
    path.write_text("sweep: {cross_check: yes}\n")  # YAML 1.1's boolean spellings are words in 1.2
    with pytest.raises(ParamsError, match="sweep.cross_check: expected bool, got 'yes'"):
        load_params(path)


BAD = [
    (
        {"sweep": {"space": {"head": ["mlp"]}}},
        "sweep.space.head: 'mlp' is not allowed; allowed: linear, conv, conv_as_linear, or "
        "package.module:factory",
    ),
    ({"sweep": {"space": {"batch_size": [0]}}}, "sweep.space.batch_size: 0 is too small; allowed: >= 1"),
    (
        {"sweep": {"space": {"amp": ["fp8"]}}},
        "sweep.space.amp: 'fp8' is not allowed; allowed: off, fp16, bf16",
    ),
    ({"sweep": {"spcae": {}}}, "sweep.spcae: unknown key; allowed: device, sampler"),
    ({"timing": {"iterations": "5"}}, "timing.iterations: expected int, got '5'"),
    ({"timing": {"warmup": True}}, "timing.warmup: expected int, got True"),
    ({"sweep": {"space": {"channels_last": [1]}}}, "sweep.space.channels_last: expected bool, got 1"),
    ({"sweep": {"space": {"head": []}}}, "sweep.space.head: expected a non-empty list"),
    ({"sweep": {"space": {"batch_size": [1, 1]}}}, "sweep.space.batch_size: duplicate values"),
    ({"sweep": {"space": {"head": "conv"}}}, "sweep.space.head: expected a non-empty list, got 'conv'"),
    ({"model": {"image_size": 100}}, "model.image_size: 100 is not allowed; allowed: a multiple of 32"),
    ({"model": {"backbone": "vgg16"}}, "model.backbone: 'vgg16' is not allowed; allowed: resnet50_fpn"),
    ({"sweep": {"device": "tpu"}}, "sweep.device: 'tpu' is not allowed; allowed: auto, cpu, cuda"),
    ({"sweep": {"sampler": "tpe"}}, "sweep.n_trials: null (whole grid) needs sampler: grid"),
    ({"sweep": {"n_trials": 0}}, "sweep.n_trials: 0 is too small"),
    ({"data": []}, "data: expected a mapping"),
    ({"colour": 1}, "colour: unknown key; allowed: data, model, sweep, timing, tracking"),
    (
        {"timing": {"iterations": 10, "max_iterations": 5}},
        "timing.max_iterations: 5 is below timing.iterations",
    ),
    ({"timing": {"rel_precision": 0}}, "timing.rel_precision: 0.0 is too small"),
    ({"sweep": {"profile_at": [{"amp": "fp8"}]}}, "sweep.profile_at.amp: 'fp8' is not allowed"),
    ({"sweep": {"profile_at": [{"head": "conv"}]}}, "sweep.profile_at.head: unknown key"),
    ({"sweep": {"profile_at": {"amp": "off"}}}, "sweep.profile_at: expected a non-empty list"),
    ({"sweep": {"space": {"onednn": ["yes"]}}}, "sweep.space.onednn: expected bool, got 'yes'"),
    ({"sweep": {"timeout_s": -5}}, "sweep.timeout_s: -5.0 is too small"),
]


@pytest.mark.parametrize("raw, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_values_name_the_key_and_what_is_allowed(raw, message):
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(ParamsError, match="nope.yaml: params file not found"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(ParamsError, match="cannot read the params file"):
        load_params(tmp_path)  # a folder
    bad = tmp_path / "bad.yaml"
    bad.write_text("sweep: [unclosed")
    with pytest.raises(ParamsError, match="bad.yaml: not valid YAML"):
        load_params(bad)
    bad.write_text("sweep: {device: tpu}")
    with pytest.raises(ParamsError, match="bad.yaml: sweep.device"):
        load_params(bad)


# The same bad value in params.yaml and on rcnn.bench's command line: params key, option, value.
SAME_RULE = [
    ("model.image_size", "--image-size", 100),
    ("sweep.space.batch_size", "--batch-size", [0]),
    ("model.rois_per_image", "--rois-per-image", 0),
    ("model.backbone", "--backbone", "vgg16"),
    ("model.representation_size", "--representation-size", 0),
    ("timing.warmup", "--warmup", -1),
    ("timing.iterations", "--iterations", 0),
    ("timing.rel_precision", "--rel-precision", 0),
    ("data.num_images", "--num-images", 0),
    ("sweep.device", "--device", "tpu"),
    ("sweep.space.head", "--head", ["mlp"]),
    ("sweep.space.amp", "--amp", ["fp8"]),
]


@pytest.mark.parametrize("key, option, value", SAME_RULE, ids=[k for k, _, _ in SAME_RULE])
def test_params_and_the_bench_command_word_a_bad_value_alike(capsys, key, option, value):
    raw: dict = {}
    *sections, name = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = value
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    with pytest.raises(SystemExit):
        bench.main([option, str(value[0] if isinstance(value, list) else value)])
    assert capsys.readouterr().err == "error: " + str(err.value).replace(key, option, 1) + "\n"


def test_a_bound_below_its_floor_is_worded_alike(capsys):
    with pytest.raises(ParamsError) as err:
        parse_params({"timing": {"iterations": 10, "max_iterations": 5}})
    with pytest.raises(SystemExit):
        bench.main(["--iterations", "10", "--max-iterations", "5"])
    words = (
        str(err.value)
        .replace("timing.max_iterations", "--max-iterations")
        .replace("timing.iterations", "--iterations")
    )
    assert capsys.readouterr().err == f"error: {words}\n"


PASSWORD = "s3cret-Pw-0451"
EMBEDDED = [  # key, a value holding PASSWORD, where the message says the password goes instead
    ("sweep.storage", f"postgresql://rcnn:{PASSWORD}@dbhost:5432/optuna", "PGPASSWORD or a ~/.pgpass entry"),
    (
        "sweep.storage",
        f"postgresql+psycopg://rcnn@dbhost/optuna?sslmode=require&password={PASSWORD}",
        "PGPASSWORD",
    ),
    (
        "tracking.mlflow_uri",
        f"http://rcnn:{PASSWORD}@trackhost:5000",
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD",
    ),
    ("tracking.mlflow_uri", f"https://rcnn:{PASSWORD}@trackhost", "MLFLOW_TRACKING_PASSWORD"),
    ("tracking.mlflow_uri", f"postgresql://rcnn:{PASSWORD}@dbhost/mlflow", "PGPASSWORD"),
    (
        "tracking.mlflow_uri",
        f"mysql+pymysql://rcnn:{PASSWORD}@dbhost/mlflow",
        "the database driver's password file",
    ),
]


@pytest.mark.parametrize(
    "key, value, where", EMBEDDED, ids=[f"{k}-{v.split(':')[0]}" for k, v, _ in EMBEDDED]
)
def test_a_url_holding_a_password_is_refused_without_echoing_it(key, value, where):
    section, name = key.split(".")
    with pytest.raises(ParamsError) as err:
        parse_params({section: {name: value}})
    message = str(err.value)
    assert (
        message.startswith(f"{key}: the URL holds a password") and "dvc.lock" in message and where in message
    )
    # Neither it nor the URL
    assert PASSWORD not in message and "dbhost" not in message and "\n" not in message


def test_the_password_check_comes_before_every_other(tmp_path):
    bad = tmp_path / "params.yaml"  # another bad key in the same section, and the file's name in front
    bad.write_text(
        f"sweep: {{storage: 'postgresql://rcnn:{PASSWORD}@dbhost/optuna', workers: 0, wrokers: 1}}"
    )
    with pytest.raises(ParamsError) as err:
        load_params(bad)
    assert str(err.value) == (
        f"{bad}: sweep.storage: the URL holds a password, and params values are recorded in "
        "dvc.lock (and so in git); remove it from the URL and pass it in the environment "
        "variable PGPASSWORD or a ~/.pgpass entry instead"
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("sweep.storage", "postgresql://rcnn@dbhost:5432/optuna?sslmode=require&passfile=/etc/rcnn/pgpass"),
        ("sweep.storage", "optuna.journal"),
        ("sweep.storage", "/srv/sweeps/user:name@host/optuna.journal"),
        ("tracking.mlflow_uri", "http://rcnn@trackhost:5000"),
        ("tracking.mlflow_uri", "sqlite:///mlflow.db"),
    ],
)
def test_urls_without_a_password_are_kept(key, value):
    section, name = key.split(".")
    assert getattr(getattr(parse_params({section: {name: value}}), section), name) == value


@pytest.mark.parametrize("preset", sorted((ROOT / "presets").glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_is_a_valid_params_file(preset):
    params = load_params(preset)
    if preset.name.startswith("model-"):  # the sweeps for a spec's model: one of each kind of spec
        assert params.model.spec.partition(":")[0] in ("torchvision", "timm", "hf")


def test_a_model_spec_is_short_for_its_mapping_and_names_its_experiment():
    default = parse_params({})
    assert (
        default.model.detector
        and default.model.image_size == 256
        and default.experiment == "roi-head-backward"
    )
    short = parse_params({"model": "timm:resnet18"})
    assert short.model == parse_params({"model": {"spec": "timm:resnet18"}}).model
    assert not short.model.detector and short.model.image_size == 224 and short.model.name == "timm-resnet18"
    assert short.experiment == "timm-resnet18" and short.model.describe() == {
        "spec": "timm:resnet18", "image_size": 224, "frames": 8
    }  # fmt: skip
    sized = parse_params({"model": {"spec": "hf:bert?num_hidden_layers=2", "image_size": 32, "frames": 4}})
    assert sized.model.image_size == 32 and sized.model.name == "hf-bert-num_hidden_layers-2"
    auto = parse_params({"model": "timm:resnet18", "sweep": {"space": {"batch_size": "auto"}}})
    assert auto.sweep.find_batch_sizes and auto.sweep.memory_limit_mb is None
    with pytest.raises(ParamsError, match="^model.frames: applies to a spec's video model only"):
        parse_params({"model": {"frames": 4}})
    with pytest.raises(ParamsError, match="^model: expected a mapping .* or a model spec, got 3"):
        parse_params({"model": 3})
