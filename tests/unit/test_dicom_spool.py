"""The DICOM node's spool writes and the node's retry waits use the project's one helper each
(``nnunet_triton.util.durable``, ``nnunet_triton.util.retry.RetryPolicy``), with the durability and delays
they had."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nnunet_triton.client.dicom import spool
from nnunet_triton.client.dicom.node import NodeConfig, parse_destination
from nnunet_triton.util.durable import TEMP_MARKER

DICOM = Path(spool.__file__).parent


def test_durable_json_makes_the_missing_folders_and_writes_the_whole_document(tmp_path: Path) -> None:
    target = tmp_path / "done" / "1.2.3" / ".state.json"
    spool.durable_json(target, {"b": 1, "a": [2]})
    assert target.read_text() == json.dumps({"b": 1, "a": [2]}, indent=1, sort_keys=True)
    assert [p.name for p in target.parent.iterdir()] == [".state.json"]  # no temporary left


def test_a_failed_spool_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "outgoing" / "1.2.3.dcm"
    spool.durable_json(target, {"old": True})
    with pytest.raises(OSError, match="disk full"), spool.durable_output(target) as temp:
        assert temp.parent == target.parent and TEMP_MARKER in temp.name  # util.durable's temporary
        temp.write_text("half")
        raise OSError("disk full")
    assert (json.loads(target.read_text()), sorted(p.name for p in target.parent.iterdir())) == (
        {"old": True}, ["1.2.3.dcm"])


def test_no_dicom_module_writes_with_its_own_fsync_and_rename_or_computes_its_own_backoff() -> None:
    sources = {path.name: path.read_text() for path in sorted(DICOM.glob("*.py"))}
    own_writers = [name for name, text in sources.items() if "os.fsync(" in text and (
        "os.replace(" in text or ".rename(" in text)]
    backoffs = [name for name, text in sources.items() if re.search(r"\*\*\s*\(?\s*attempt", text)]
    assert (own_writers, backoffs) == ([], [])


@pytest.mark.parametrize(("delay", "longest", "expected"), [(5.0, 300.0, [5.0, 10.0, 20.0, 40.0, 80.0]),
                                                           (5.0, 12.0, [5.0, 10.0, 12.0, 12.0, 12.0]),
                                                           (0.0, 300.0, [0.0] * 5)])
def test_the_node_waits_retry_delay_doubling_up_to_the_longest_delay(tmp_path, delay, longest,
                                                                     expected) -> None:
    config = NodeConfig(ae_title="NNUNET", port=11112, spool=tmp_path,
                        destination=parse_destination("DEST@127.0.0.1:104", calling_ae="NNUNET"),
                        segment=lambda volume: volume, retry_delay_s=delay, max_retry_delay_s=longest)
    assert [config.retry_policy.delay(attempt) for attempt in range(5)] == expected
