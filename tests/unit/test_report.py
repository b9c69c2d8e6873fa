"""Run tables: the headline figures, ratios to the base run, and backward masking's refresh."""

from __future__ import annotations

from subnetdp.commands.report import comparison_table, format_summary


def _summary(strategy: str, loss: float, params: int, refresh: int = 0) -> dict:
    return {"strategy": strategy, "recipe": "llama-tiny", "coverage": 0.5, "world": 2,
            "steps": 10, "final_train_loss": loss, "val_loss": loss, "step_time_s": 2.0,
            "per_rank": [{"params_held": params, "peak_memory_bytes": 2 * params,
                          "comm_bytes_per_step": 4 * params, "refresh_bytes_per_step": refresh}
                         for _ in range(2)]}


def test_table_has_one_column_and_one_ratio_per_run() -> None:
    ddp, b, bb = (_summary("ddp", 4.0, 100), _summary("b-sdp", 5.0, 50),
                  _summary("bb-sdp", 4.4, 100, refresh=2**20))
    table = comparison_table(ddp, b, bb)
    lines = table.splitlines()
    assert "b-sdp (C=0.5)" in lines[0] and "bb-sdp / ddp" in lines[0]
    loss_row = next(line for line in lines if line.startswith("val loss"))
    assert loss_row.split()[-2:] == ["1.250", "1.100"]
    refresh_row = next(line for line in lines if line.startswith("refresh sent"))
    assert refresh_row.split()[-2:] == ["-", "-"]  # no ratio to a base that sends nothing
    assert "refresh sent" not in comparison_table(ddp, b)
    assert "refresh / step" in format_summary(bb) and "refresh" not in format_summary(b)
