import numpy as np
import pandas as pd
import pytest

from pipeline.common import read_json
from pipeline.results import (
    ALL_SETTINGS,
    COMPARED_PHASES,
    comparisons_table,
    head_order,
    head_pairs,
    linearize_gain,
    pooled_rows,
    read_comparisons,
    read_env,
    read_table,
    read_trials,
    summarize_trials,
    trial_row,
    write_trials,
)
from rcnn.trial.schema import (
    COMPARISON_COLUMNS,
    KERNEL_COLUMNS,
    MEASURED_COLUMNS,
    TRIAL_COLUMNS,
    ResultsError,
)
from tests.conftest import ROOT
from tests.conftest import fake_trials as fixture


def test_comparisons_per_setting_and_pooled():
    trials, samples = fixture()
    table = comparisons_table(trials, samples)
    per_setting = table[table["settings"] == 1]
    conv = per_setting[(per_setting["numerator"] == "conv") & (per_setting["phase"] == "head_backward")]
    assert len(conv) == 2  # the failed trial's setting has no complete pair
    assert conv["ratio"].tolist() == pytest.approx([4.0, 4.0], rel=0.02)
    assert (conv["ci_low"] < conv["ratio"]).all() and (conv["ratio"] < conv["ci_high"]).all()
    assert (conv["p_value"] < 1e-4).all()
    pooled = table[
        (table["batch_size"] == ALL_SETTINGS)
        & (table["numerator"] == "conv_as_linear")
        & (table["phase"] == "backward")
    ]
    assert pooled["ratio"].iloc[0] == pytest.approx(1.01, rel=0.01) and pooled["settings"].iloc[0] == 2

    summary = summarize_trials(trials, table)
    assert (
        summary["trials"] == 7
        and summary["complete"] == 6
        and summary["failed"] == 1
        and summary["not_run"] == 0
    )
    assert summary["conv_over_linear_head_backward"] == pytest.approx(4.0, rel=0.02)
    assert (
        summary["conv_over_linear_head_backward_ci_low"]
        < 4.0
        < summary["conv_over_linear_head_backward_ci_high"]
    )
    assert summary["best"] == {
        "head": "linear",
        "cudnn_benchmark": "n/a",
        "onednn": True,
        "amp": "off",
        "channels_last": False,
        "batch_size": 1,
        "linearize": False,
        "tf32": "n/a",
        "compile": "off",
        "step_ms": pytest.approx(200, rel=0.02),
        "ms_per_image": pytest.approx(200, rel=0.02),
    }


def test_a_ratio_is_read_from_the_heads_stepped_in_turn_where_the_numerators_trial_did_so():
    trials, samples = fixture()
    conv = trials.query("head == 'conv' and status == 'complete' and batch_size == 1")["trial"].iloc[0]
    # In turn, conv's rounds are 1.5x linear's, each round moved alike by the machine (0.5x-2x): paired, the
    # ratio and its CI hold that; unpaired, the two trials' own steps give 4x.
    load = np.random.default_rng(1).uniform(0.5, 2.0, 9)
    in_turn = {
        head: {phase: list(load * base * (1.5 if head == "conv" else 1.0)) for phase in COMPARED_PHASES}
        for head, base in (("conv", 10.0), ("linear", 10.0))
    }
    table = comparisons_table(trials, samples, paired={conv: in_turn})
    rows = table[(table["settings"] == 1) & (table["numerator"] == "conv")].set_index(["batch_size", "phase"])
    paired, alone = rows.loc[(1, "head_backward")], rows.loc[(2, "head_backward")]
    assert paired["rounds"] == 9 and paired["ratio"] == pytest.approx(1.5)
    assert paired["ci_low"] == pytest.approx(1.5) and paired["ci_high"] == pytest.approx(1.5)
    assert paired["p_value"] < 0.01  # Wilcoxon signed-rank over the rounds
    assert alone["rounds"] == 0 and alone["ratio"] == pytest.approx(4.0, rel=0.02)
    pooled = table.query("batch_size == 'all' and numerator == 'conv' and phase == 'head_backward'")
    assert pooled["ratio"].iloc[0] == pytest.approx((1.5 * 4.0) ** 0.5, rel=0.02)  # the paired one pooled
    assert table.query("batch_size == 'all'")["rounds"].isna().all()
    # linear's own trial of that setting failed: the ratio read in turn stands; without it, no row
    linear = trials.query("head == 'linear' and batch_size == 1")["trial"].iloc[0]
    trials.loc[trials["trial"] == linear, "status"] = "failed"
    rows = comparisons_table(trials, samples, paired={conv: in_turn}).query("numerator == 'conv'")
    assert rows.query("batch_size == 1 and phase == 'head_backward'")["ratio"].tolist() == pytest.approx(
        [1.5]
    )
    assert comparisons_table(trials, samples).query("batch_size == 1").empty


def test_a_swept_compile_gets_pooled_rows_per_value_and_stays_out_of_the_headline():
    trials, samples = fixture()
    # The batch-2 settings become compiled head ones whose conv head is as fast as linear.
    compiled = trials["batch_size"] == 2
    trials.loc[compiled, "compile"] = "head"
    for trial in trials[compiled & (trials["head"] == "conv") & (trials["status"] == "complete")]["trial"]:
        samples[trial] = {**samples[trial], "head_backward": [x / 4 for x in samples[trial]["head_backward"]]}
    table = comparisons_table(trials, samples)
    gap = dict(iter(pooled_rows(table, "compile").groupby("compile")))  # a GroupBy has .keys: not a mapping
    conv = {
        value: rows[
            (rows["numerator"] == "conv")
            & (rows["denominator"] == "linear")
            & (rows["phase"] == "head_backward")
        ]
        for value, rows in gap.items()
    }
    assert conv["off"]["ratio"].iloc[0] == pytest.approx(4.0, rel=0.02)
    assert conv["head"]["ratio"].iloc[0] == pytest.approx(1.0, rel=0.02)
    assert (conv["head"][["cudnn_benchmark", "batch_size", "tf32"]] == ALL_SETTINGS).all(axis=None)
    headline = summarize_trials(trials, table)  # the uncompiled settings only: batch 1
    assert headline["conv_over_linear_head_backward"] == pytest.approx(4.0, rel=0.02)
    assert pooled_rows(table)["settings"].max() == 1


def test_best_setting_is_the_least_time_per_image_not_per_step():
    trials, samples = fixture()
    batch_2 = trials["batch_size"] == 2
    trials.loc[batch_2, "step_ms"] *= 0.75  # 1.5x the time per step of batch 1, 0.75x per image
    best = summarize_trials(trials, comparisons_table(trials, samples))["best"]
    assert best["batch_size"] == 2 and best["head"] == "linear"
    assert best["ms_per_image"] == pytest.approx(best["step_ms"] / 2, rel=0.01)


def test_without_linear_heads_are_compared_with_the_first_and_the_headline_is_none():
    trials, samples = fixture()
    only = trials.query("head != 'linear'")
    table = comparisons_table(only, samples)
    assert set(zip(table["numerator"], table["denominator"])) == {("conv_as_linear", "conv")}
    summary = summarize_trials(only, table)
    assert summary["conv_over_linear_head_backward"] is None
    assert summary["conv_as_linear_over_conv_head_backward"] == pytest.approx(
        table.query("phase == 'head_backward' and onednn == 'all'")["ratio"].iloc[0], abs=1e-3
    )


def test_head_pairs_take_users_heads_after_the_built_in_ones():
    user = "tests.fixtures.question_heads:conv"
    users_linear = "tests.fixtures.question_heads:linear"
    assert head_pairs(["conv", user, "linear"]) == [("conv", "linear"), (user, "linear")]
    # The sweep's first
    assert head_pairs([user, users_linear], reference=users_linear) == [(user, users_linear)]
    assert head_pairs([user, users_linear]) == [(users_linear, user)]
    assert head_order(["b:x", "conv", "a:y"]) == ["conv", "a:y", "b:x"]
    assert head_pairs([]) == []


def test_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "trials.csv"
    write_trials(fixture()[0], path)
    back = read_trials(path)
    assert list(back.columns) == list(TRIAL_COLUMNS) and back["cudnn_benchmark"].eq("n/a").all()
    path.write_text("trial,status\n0,complete\n")
    with pytest.raises(ResultsError, match="trials.csv: missing columns device"):
        read_trials(path)
    with pytest.raises(ResultsError, match="run the sweep stage first"):
        read_trials(tmp_path / "none.csv")
    with pytest.raises(ResultsError, match="cannot read it as the sweep table"):
        read_trials(tmp_path)  # a folder given for the file
    with pytest.raises(ResultsError, match="cannot read it"):
        read_env(tmp_path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ResultsError, match="trials.csv"):
        read_trials(path)


def test_a_table_from_before_a_column_is_refused_not_filled(tmp_path):
    path = tmp_path / "trials.csv"
    write_trials(fixture()[0], path)
    read_trials(path).drop(columns=["tf32", "wall_build_s"]).to_csv(path, index=False)
    with pytest.raises(
        ResultsError, match="trials.csv: missing columns tf32, wall_build_s; run the sweep stage"
    ):
        read_trials(path)


def test_the_h200_reference_run_reads_as_the_sweep_writes_it():
    """reports/h200 (migrated once to the current columns) loads with today's readers, and its tables agree
    with its summary."""
    folder = ROOT / "reports" / "h200"
    trials = read_trials(folder / "trials.csv")
    assert list(trials.columns) == list(TRIAL_COLUMNS)
    summary = read_json(folder / "summary.json")
    assert len(trials) == summary["trials"] == 72
    assert (trials["status"] == "complete").sum() == summary["complete"]
    assert (trials["status"] == "not run").sum() == summary["not_run"]
    assert set(trials["device"]) == {read_env(folder / "env.json")["fingerprint"]["device"]} == {"cuda"}
    # From before the knobs existed: the heads as written, uncompiled, TF32 off (sweep.allow_tf32's default).
    assert not trials["linearize"].any() and trials["compile"].eq("off").all() and not trials["tf32"].any()
    assert trials["swapped"].isna().all() and trials["wall_measure_s"].isna().all()
    comparisons = read_comparisons(folder / "comparisons.csv")
    assert list(comparisons.columns) == list(COMPARISON_COLUMNS)
    assert comparisons["rounds"].isna().all()  # from before heads were stepped in turn in a trial
    assert list(read_table(folder / "kernels.csv", KERNEL_COLUMNS, "sweep").columns) == list(KERNEL_COLUMNS)


def test_trial_row_refuses_a_misspelt_or_missing_column():
    setup = {
        "trial": 0,
        "status": "failed",
        "device": "cpu",
        "model": "detector",
        "backbone": "resnet18_fpn",
        "image_size": 256,
        "rois_per_image": 128,
        "head": "conv",
        "cudnn_benchmark": "n/a",
        "onednn": True,
        "amp": "off",
        "channels_last": False,
        "batch_size": 1,
        "linearize": False,
        "tf32": "n/a",
        "compile": "off",
        "mlflow_run_id": None,
        "worker": None,
        "error": "x",
    }
    row = trial_row(None, **setup)
    # NaN: nothing measured
    assert list(row) == list(TRIAL_COLUMNS) and all(row[c] != row[c] for c in MEASURED_COLUMNS)
    measured = dict.fromkeys(MEASURED_COLUMNS, 1.0)
    assert trial_row(measured, **setup)["step_ms"] == 1.0
    with pytest.raises(ValueError, match="unknown \\['stepms'\\]"):
        trial_row({**measured, "stepms": 1.0}, **setup)
    with pytest.raises(ValueError, match="missing \\['step_ms'\\]"):
        trial_row({k: v for k, v in measured.items() if k != "step_ms"}, **setup)
    with pytest.raises(ValueError, match="setup and record columns: unknown \\[\\], missing \\['worker'\\]"):
        trial_row(measured, **{k: v for k, v in setup.items() if k != "worker"})
    with pytest.raises(
        ValueError, match="measured columns: unknown \\['trial'\\]"
    ):  # would overwrite the setup's
        trial_row({**measured, "trial": 9}, **setup)


def test_pooled_ratios_leave_out_the_settings_with_the_automatic_fix():
    trials, samples = fixture()
    pooled = comparisons_table(trials, samples).query("batch_size == 'all' and phase == 'head_backward'")
    fixed = trials[trials["status"] == "complete"].copy()
    fixed["linearize"] = True
    fixed["trial"] += 100
    extra = {
        t + 100: {
            p: [
                v * (0.3 if fixed.loc[fixed["trial"] == t + 100, "head"].item() == "conv" else 1)
                for v in values
            ]
            for p, values in s.items()
        }
        for t, s in samples.items()
        if s
    }
    both = comparisons_table(pd.concat([trials, fixed]), samples | extra)
    assert (both["linearize"].astype(str) == "True").any()  # compared per setting, with the fix too ...
    again = both.query("batch_size == 'all' and phase == 'head_backward'")
    assert again["ratio"].tolist() == pooled["ratio"].tolist()  # ... but the headline is the heads as written


def test_a_head_faster_than_the_measured_peak_raises_the_ceiling_and_no_fraction_exceeds_one():
    from pipeline.analysis import within_ceilings

    trials = pd.DataFrame(
        {
            "amp": ["off", "off", "bf16"],
            "tf32": ["n/a"] * 3,
            "head_forward_tflops": [0.10, 0.20, 0.5],
            "head_backward_tflops": [0.25, 0.05, 0.6],
            "head_forward_peak_fraction": [0.5, 1.0, 0.5],
            "head_backward_peak_fraction": [1.25, 0.25, 0.6],
        }
    )
    fixed, raised = within_ceilings(trials, {"matmul_tflops": {"fp32": 0.2, "bf16": 1.0}})
    assert raised == {"fp32": 0.25}  # bf16's ceiling held
    assert fixed["head_backward_peak_fraction"].tolist() == pytest.approx([1.0, 0.2, 0.6])
    assert fixed["head_forward_peak_fraction"].tolist() == pytest.approx([0.4, 0.8, 0.5])
    same, none = within_ceilings(trials, {"matmul_tflops": {"fp32": 1.0, "bf16": 1.0}})
    assert none == {} and same is trials


def with_linearize(gain_outside: float, gain_head: float = 1.0) -> tuple[pd.DataFrame, dict]:
    """The fixture's trials, each also with linearize true: the backward less the box head's own
    ``gain_outside`` times shorter, the box head's ``gain_head`` times."""
    trials, samples = fixture()
    done = trials[trials["status"] == "complete"]
    extra = done.copy()
    extra["linearize"] = True
    extra["trial"] = extra["trial"] + 100
    for old, new in zip(done["trial"], extra["trial"]):
        head = np.asarray(samples[old]["head_backward"]) / gain_head
        rest = (
            np.asarray(samples[old]["backward"]) - np.asarray(samples[old]["head_backward"])
        ) / gain_outside
        samples[new] = {
            "head_backward": list(head),
            "backward": list(head + rest),
            "step": samples[old]["step"],
        }
    return pd.concat([trials, extra], ignore_index=True), samples


def test_linearize_gain_pools_the_pairs_that_differ_in_it_alone_whole_and_beyond_the_box_head():
    trials, samples = with_linearize(gain_outside=2.0, gain_head=4.0)
    gain = linearize_gain(trials, samples)
    assert gain["backward"]["pairs"] == 6 and set(gain["by_head"]) == {"linear", "conv", "conv_as_linear"}
    assert gain["beyond_box_head"]["ratio"] == pytest.approx(2.0, rel=0.02)
    low, high = gain["beyond_box_head"]["ci_low"], gain["beyond_box_head"]["ci_high"]
    assert low <= 2.0 <= high * 1.001 and high - low < 0.1
    assert 2.0 < gain["backward"]["ratio"] < 4.0  # the box head's gain mixed in
    # trials that never ran linearize both ways: nothing to say
    plain, plain_samples = fixture()
    assert linearize_gain(plain, plain_samples) is None
