"""A client in another language, written against the JSON Schemas only (schemas/json/): Node's
kafkajs publishes a run's metrics on the embedded broker, a real worker alerts on the NaN, and
the same client reads the alert back."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from tests.integration import WorkerProcess
from tests.test_schemas import published

pytestmark = pytest.mark.integration

CLIENT = Path(__file__).resolve().parent / "clients" / "node"


@pytest.fixture(scope="module")
def node_client():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm not installed (make system / scripts/setup-system.sh installs them)")
    if not (CLIENT / "node_modules" / "kafkajs").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENT, check=True, capture_output=True,
                       timeout=300)
    return CLIENT / "run_client.js"


def test_a_node_trainer_gets_its_nan_alert_through_a_real_worker(kafka, tmp_path, node_client):
    worker = WorkerProcess(kafka, tmp_path).start()
    try:
        worker.wait_ready()
        prefix = kafka.topics.events.rsplit(".", 1)[0]
        result = subprocess.run(["node", str(node_client), kafka.bootstrap, prefix, "node-run-1"],
                                capture_output=True, text=True, timeout=120)
    finally:
        worker.kill()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n--- worker ---\n{worker.log()[-2000:]}"
    alert = json.loads(result.stdout.strip().splitlines()[-1])
    jsonschema.validate(alert, published("alert/1"))
    assert alert["rule"] == "non_finite" and alert["step"] == 6 and alert["severity"] == "P0"
