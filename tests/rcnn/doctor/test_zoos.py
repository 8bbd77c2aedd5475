"""timm and transformers models by name, on tiny configs: each builds, takes its batch and trains a step."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from rcnn.doctor.workloads import build_workload
from rcnn.doctor.zoos import split_options
from rcnn.rules import ValueNotAllowed
from tests.conftest import ROOT

CPU = torch.device("cpu")
installed = pytest.mark.skipif(
    not (importlib.util.find_spec("timm") and importlib.util.find_spec("transformers")),
    reason="needs timm and transformers (requirements.txt; pip install '.[zoo]')",
)

# Transformers' default configs are the full models: these shrink each to a layer or two of width 32.
TINY = "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64"
HF_SPECS = {
    "vit": f"hf:vit?{TINY},patch_size=8",
    "convnext": "hf:convnext?num_stages=2,depths=(1,1),hidden_sizes=(16,32)",
    "bert": f"hf:bert?{TINY},vocab_size=500",
    "gpt2": "hf:gpt2?n_layer=1,n_embd=32,n_head=2,vocab_size=500",
    "wav2vec2": f"hf:wav2vec2?{TINY},conv_dim=(16,16),conv_stride=(5,4),conv_kernel=(10,4),"
    "num_conv_pos_embeddings=16,num_conv_pos_embedding_groups=2",
    "whisper": "hf:whisper?d_model=32,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,"
    "decoder_attention_heads=2,encoder_ffn_dim=64,decoder_ffn_dim=64,max_source_positions=16,"
    "max_target_positions=16",
}


def _step(spec: str, image_size: int = 32):
    workload = build_workload(spec, batch_size=2, image_size=image_size, device=CPU)
    loss = workload.loss(workload.model, workload.batch)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert any(p.grad is not None for p in workload.model.parameters())
    return workload


@installed
def test_a_timm_vit_is_built_for_the_image_size():
    workload = _step("timm:vit_tiny_patch16_224", image_size=32)
    assert workload.model.patch_embed.grid_size == (2, 2)  # 32 px in 16 px patches, not 224's 14 x 14
    assert workload.batch_description == "float32 (2, 3, 32, 32)"


@installed
def test_a_timm_model_without_img_size_takes_any_size():
    workload = _step("timm:resnet10t?num_classes=10", image_size=48)
    assert workload.model.fc.out_features == 10


@installed
@pytest.mark.parametrize(
    "kind, keys",
    [
        ("vit", {"pixel_values": (2, 3, 32, 32), "labels": (2,)}),
        ("convnext", {"pixel_values": (2, 3, 32, 32), "labels": (2,)}),
        ("bert", {"input_ids": (2, 128), "labels": (2, 128)}),
        ("gpt2", {"input_ids": (2, 128), "labels": (2, 128)}),
        ("wav2vec2", {"input_values": (2, 16000), "labels": (2, 8)}),
        ("whisper", {"input_features": (2, 80, 32), "labels": (2, 16)}),
    ],
)
def test_hf_models_train_on_the_batch_of_their_head(kind, keys):
    workload = _step(HF_SPECS[kind])
    assert {key: tuple(value.shape) for key, value in workload.batch.items()} == keys


@installed
def test_hf_image_models_see_the_image_size():
    workload = build_workload(HF_SPECS["vit"], batch_size=1, image_size=48, device=CPU)
    assert workload.model.config.image_size == 48
    assert workload.batch["pixel_values"].shape[-1] == 48


@installed
def test_hf_options_given_as_keywords_join_the_specs():
    workload = build_workload(HF_SPECS["bert"], batch_size=1, image_size=32, device=CPU, vocab_size=300)
    assert workload.model.config.vocab_size == 300 and workload.model.config.num_hidden_layers == 1


def test_options_parse_as_python_keywords():
    name, options = split_options("bert?num_hidden_layers=2,hidden_act=gelu,conv=(1, 2),p=0.1,x='a b'", "hf")
    assert name == "bert"
    assert options == {"num_hidden_layers": 2, "hidden_act": "gelu", "conv": (1, 2), "p": 0.1, "x": "a b"}
    assert split_options("resnet10t", "timm") == ("resnet10t", {})


@installed
@pytest.mark.parametrize(
    "spec, words",
    [
        ("timm:vit_tiny_patch16", "not a timm model; allowed: one of the "),
        ("timm:vit_tiny_patch16", "timm.list_models()"),
        ("timm:vit_tiny_patch16", "closest: vit_tiny_patch16_384, vit_tiny_patch16_224"),
        ("timm:resnet10t?no_such_option=1", "timm.create_model('resnet10t', pretrained=False, ...) raised"),
        ("hf:bertt", "not a transformers model_type; allowed: one of the "),
        ("hf:bertt", "closest: bert"),
        ("hf:google-bert/bert-base-uncased", "not a Hub repo id: nothing is downloaded"),
        ("hf:bert?num_layers=2", "its config has no num_layers (closest: num_hidden_layers"),
        ("hf:bert?2", "must all be key=value"),
        ("hf:bert?num_hidden_layers=", "not key=value"),
        ("hf:bert?hidden_act=f(x)", "is not a literal"),
    ],
)
def test_wrong_names_get_one_line_with_what_is_allowed(spec, words):
    with pytest.raises(ValueNotAllowed, match="MODEL: ") as err:
        build_workload(spec, batch_size=1, image_size=32, device=CPU)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "package, spec",
    [("timm", "timm:resnet10t"), ("transformers", "hf:bert")],
)
def test_without_the_package_the_line_names_the_pip_command(monkeypatch, package, spec):
    monkeypatch.setitem(sys.modules, package, None)  # import fails, as where it is not installed
    with pytest.raises(ValueNotAllowed, match="MODEL: ") as err:
        build_workload(spec, batch_size=1, image_size=32, device=CPU)
    assert f"needs {package}" in str(err.value)
    assert f"pip install {package}" in str(err.value) and "roi-head-sweep[zoo]" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # a fresh interpreter: the point is what it imports
def test_the_doctor_imports_the_zoos_only_when_named():
    check = (
        "import sys, rcnn.doctor.workloads; "
        "assert not {'timm', 'transformers', 'rcnn.doctor.zoos'} & set(sys.modules), sys.modules.keys()"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
