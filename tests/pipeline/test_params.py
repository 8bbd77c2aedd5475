import pytest

from pipeline.params import Params, ParamsError, load_params, parse_params
from tests.conftest import ROOT


def test_repo_params_load_and_freeze():
    params = load_params(ROOT / "params.yaml")
    assert params.sweep.space.head == ("linear", "conv", "conv_as_linear")
    assert params.sweep.n_trials is None and params.timing.iterations >= 1
    with pytest.raises(AttributeError):
        params.sweep.device = "cuda"


def test_missing_keys_take_defaults():
    assert parse_params({}) == Params()


BAD = [
    ({"sweep": {"space": {"head": ["mlp"]}}}, "sweep.space.head: 'mlp' is not allowed; allowed: linear, conv, conv_as_linear"),
    ({"sweep": {"space": {"batch_size": [0]}}}, "sweep.space.batch_size: 0 is too small; allowed: >= 1"),
    ({"sweep": {"space": {"amp": ["fp8"]}}}, "sweep.space.amp: 'fp8' is not allowed; allowed: off, fp16, bf16"),
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
    ({"timing": {"iterations": 10, "max_iterations": 5}}, "timing.max_iterations: 5 is below timing.iterations"),
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
    bad = tmp_path / "bad.yaml"
    bad.write_text("sweep: [unclosed")
    with pytest.raises(ParamsError, match="bad.yaml: not valid YAML"):
        load_params(bad)
    bad.write_text("sweep: {device: tpu}")
    with pytest.raises(ParamsError, match="bad.yaml: sweep.device"):
        load_params(bad)
