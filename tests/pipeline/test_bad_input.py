"""Bad input, catalogued: each case stops the sweep stage with one line naming the key or file and what is
allowed, a non-zero exit, and the results of an earlier run left as they were."""
import json
import shutil

import pytest
from PIL import Image

from pipeline import data, env, sweep
from tests.conftest import write_tiny_params

OUTPUTS = {"trials": "trials.csv", "comparisons": "comparisons.csv", "kernels": "kernels.csv",
           "summary": "summary.json"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One data folder and env.json for every case (each case works on its own copy)."""
    folder = tmp_path_factory.mktemp("prepared")
    params = write_tiny_params(folder)
    assert data.main(["--params", str(params), "--out", str(folder / "data")]) == 0
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


CASES = [  # id, params override, what is done to the files, what the one line must say
    ("wrong-type", {"timing": {"iterations": "5"}}, None, "timing.iterations: expected int, got '5'"),
    ("unknown-key", {"sweep": {"wrokers": 2}}, None, "sweep.wrokers: unknown key; allowed: device"),
    ("empty-grid", {"sweep": {"space": {"head": []}}}, None, "sweep.space.head: expected a non-empty list"),
    ("impossible-grid", {"sweep": {"space": {"amp": ["fp16"]}}}, None, "sweep.space.amp: no value applies on cpu"),
    ("zero-batch", {"sweep": {"space": {"batch_size": [0]}}}, None, "sweep.space.batch_size: 0 is too small"),
    ("zero-workers", {"sweep": {"workers": 0}}, None, "sweep.workers: 0 is too small; allowed: >= 1"),
    ("negative-timeout", {"sweep": {"trial_timeout_s": -1}}, None, "sweep.trial_timeout_s: -1.0 is too small"),
    ("zero-rois", {"model": {"rois_per_image": 0}}, None, "model.rois_per_image: 0 is too small"),
    ("unknown-backbone", {"model": {"backbone": "vgg16"}}, None, "model.backbone: 'vgg16' is not allowed; allowed:"),
    ("unreachable-storage", {"sweep": {"storage": "postgresql://rcnn@127.0.0.1:1/none"}}, None,
     "sweep.storage: cannot open postgresql://rcnn@127.0.0.1:1/none"),
    ("unreachable-tracking", {"tracking": {"mlflow_uri": "http://127.0.0.1:1"}}, None,
     "tracking.mlflow_uri: no MLflow server answers at http://127.0.0.1:1"),
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
def test_bad_input_stops_with_one_line_and_keeps_earlier_results(tmp_path, tiny_params, prepared, capsys,
                                                                  override, damage, message):
    ws = {"root": tmp_path, "data": tmp_path / "data", "env": tmp_path / "env.json", "extra": []}
    shutil.copytree(prepared / "data", ws["data"])
    shutil.copy(prepared / "env.json", ws["env"])
    earlier = {}
    for key, name in OUTPUTS.items():  # an earlier run's results
        ws[key] = tmp_path / name
        ws[key].write_text(f"earlier {key}\n")
        earlier[ws[key]] = ws[key].read_text()
    if damage:
        damage(ws)
    argv = ["--params", str(tiny_params(override)), "--data", str(ws["data"]), "--env", str(ws["env"]),
            *[a for key in OUTPUTS for a in (f"--{key}", str(ws[key]))], *ws["extra"]]
    capsys.readouterr()

    code = sweep.main(argv)

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert {path: path.read_text() for path in earlier} == earlier


def test_the_catalogue_holds_at_least_15_bad_inputs():
    assert len(CASES) >= 15
