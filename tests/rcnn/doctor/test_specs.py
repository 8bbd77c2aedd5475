"""A spec's vocabulary without torch: its form, its name in files, and which specs are the user's code."""

import pytest

from rcnn.doctor import workloads
from rcnn.doctor.specs import BUILT_IN_KINDS, MODEL_SPEC, is_factory, spec_slug


@pytest.mark.parametrize(
    "spec", ["timm:resnet18", "torchvision:mobilenet_v3_small", "hf:bert?num_hidden_layers=2", "pkg.mod:make"]
)
def test_a_spec_of_each_form_is_allowed(spec):
    assert MODEL_SPEC.problem(spec) is None


@pytest.mark.parametrize("spec", ["resnet18", "timm:", ":resnet18", "timm: resnet18", "timm:?x=1"])
def test_what_is_not_a_spec_is_refused_naming_the_forms(spec):
    assert MODEL_SPEC.problem(spec).endswith(
        "allowed: a model spec: " + MODEL_SPEC.other[1].split(": ", 1)[1]
    )


def test_the_built_in_kinds_are_those_the_workloads_build():
    assert set(BUILT_IN_KINDS) == {*workloads.ZOOS, *workloads.LIBRARIES, "torchvision"}
    assert is_factory("tests.fixtures.models:pooled") and not is_factory("timm:resnet18")


def test_a_spec_names_a_folder():
    assert spec_slug("timm:resnet18") == "timm-resnet18"
    assert (
        spec_slug("hf:bert?num_hidden_layers=2,hidden_size=128")
        == "hf-bert-num_hidden_layers-2-hidden_size-128"
    )
    assert spec_slug("pkg.models:make") == "pkg.models-make"
