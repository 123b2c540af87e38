"""factory/cockpit/reports.py compare_sweep: members ranked by their result (with n), and a best member that
"wins" only when the interval of its difference from the runner-up excludes 0."""

from __future__ import annotations

import datetime as dt
import json

from factory.cockpit.reports import compare_sweep

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def _sweep(lake, sweep_id: str, accuracies: list[float], n: int = 500) -> None:
    lake.upsert("sweeps", [dict(sweep_id=sweep_id, member=f"{sweep_id}-m00{i}", name=sweep_id,
                                axes=json.dumps({"algorithm.lr": lr}), spec="{}", status="succeeded",
                                run_id=f"{sweep_id}-r{i}", final_accuracy=acc, created_at=T0, recorded_at=T0)
                           for i, (lr, acc) in enumerate(zip((1e-3, 3e-3, 1e-2), accuracies, strict=False))])
    lake.upsert("evals", [dict(run_id=f"{sweep_id}-r{i}", step=step, benchmark="arithmetic_heldout",
                               metric="accuracy", value=acc if step else 0.5, n=n, recorded_at=T0)
                          for i, acc in enumerate(accuracies) for step in (0, 40)])


def test_a_best_member_inside_the_noise_is_no_win(lake):
    """Issue 24: a sweep's best member "won" 0.722 vs 0.702 on one seed."""
    _sweep(lake, "s", [0.702, 0.722, 0.5])
    cmp = compare_sweep(lake, "s")
    assert [m.member for m in cmp.members] == ["s-m001", "s-m000", "s-m002"]
    assert cmp.members[0].accuracy_text() == "0.722 [0.681, 0.759] n=500"
    assert cmp.best == ["s-m001", "s-m000"]  # m002 is significantly worse; m000 is not
    assert cmp.verdict == ("no significant difference between m001 (lr=3e-3) and m000 "
                           "(lr=1e-3) (diff +0.020 [-0.036, +0.076], n=500 each)")


def test_a_best_member_well_ahead_wins(lake):
    _sweep(lake, "w", [0.6, 0.8])
    cmp = compare_sweep(lake, "w")
    assert cmp.best == ["w-m001"]
    assert cmp.verdict.startswith("m001 (lr=3e-3) wins (diff +0.200 [+0.")


def test_members_known_only_by_their_sweeps_row_tie_on_equal_accuracy(lake):
    lake.upsert("sweeps", [dict(sweep_id="t", member=f"t-m00{i}", name="t", axes=json.dumps({"seed": i}), spec="{}",
                                status="succeeded", final_accuracy=0.5, created_at=T0, recorded_at=T0)
                           for i in range(2)])
    cmp = compare_sweep(lake, "t")
    assert cmp.best == ["t-m000", "t-m001"] and cmp.verdict == ""
    assert cmp.members[0].accuracy_text() == "0.500"


def _seed_sweep(lake, sweep_id: str, by_lr: dict[float, list[float]], n: int = 500) -> None:
    members = [(lr, seed, acc) for lr, accs in by_lr.items() for seed, acc in enumerate(accs)]
    lake.upsert("sweeps", [dict(sweep_id=sweep_id, member=f"{sweep_id}-m{i:03d}", name=sweep_id,
                                axes=json.dumps({"algorithm.lr": lr, "seed": seed}), spec="{}", status="succeeded",
                                run_id=f"{sweep_id}-r{i}", final_accuracy=acc, created_at=T0, recorded_at=T0)
                           for i, (lr, seed, acc) in enumerate(members)])
    lake.upsert("evals", [dict(run_id=f"{sweep_id}-r{i}", step=40, benchmark="arithmetic_heldout", metric="accuracy",
                               value=acc, n=n, recorded_at=T0) for i, (_, _, acc) in enumerate(members)])


def test_a_seed_axis_ranks_points_by_their_mean_over_seeds(lake):
    _seed_sweep(lake, "k", {3e-3: [0.60, 0.61, 0.62], 1e-3: [0.70, 0.72, 0.71]})
    cmp = compare_sweep(lake, "k")
    assert [p.label for p in cmp.points] == ["lr=1e-3", "lr=3e-3"]
    top = cmp.points[0]
    assert (top.seeds, top.accuracies, top.n) == ([0, 1, 2], [0.70, 0.72, 0.71], 500)
    assert top.text() == "0.710 [0.685, 0.735] over 3 seeds, n=500 each"
    assert cmp.point_verdict == "lr=1e-3 wins (mean diff +0.100 [+0.077, +0.123], 3 and 3 seeds)"


def test_points_whose_seeds_overlap_are_no_win(lake):
    _seed_sweep(lake, "o", {1e-3: [0.70, 0.74, 0.66], 3e-3: [0.69, 0.71, 0.67]})
    cmp = compare_sweep(lake, "o")
    assert cmp.point_verdict.startswith("no significant difference between lr=1e-3 and "
                                        "lr=3e-3 (mean diff +0.010 [-")


def test_a_sweep_without_a_seed_axis_has_no_points(lake):
    _sweep(lake, "p", [0.6, 0.8])
    assert compare_sweep(lake, "p").points == []
