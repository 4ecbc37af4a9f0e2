"""records=[...] publishes only the records named, whatever a micro-batch returns."""

from __future__ import annotations

from test_metrics import drive, out, recorder

from toolkit.plugins._metrics import log_metrics


def test_records_keeps_out_an_unnamed_record_when_a_named_one_is_missing() -> None:
    # Bug caught: records=["acc", "f1"] and a micro-batch with {"acc", "extra"} published
    # train/extra (two records for two names read as "all chosen", so none was dropped).
    rows, _, sink = recorder()
    records = {"acc": 0.5, "extra": 2.0}
    drive(log_metrics(1, sinks=[sink], records=["acc", "f1"]), [out(1.0, records=records)])
    assert sorted(k for k in rows[0][1] if k.startswith("train/")) == ["train/acc", "train/loss"]
