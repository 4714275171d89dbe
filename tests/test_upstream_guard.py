"""The worker's overrides of Faust, aiokafka and mode internals follow the upstream code they
were written against: an upgrade that changes any of it fails here, naming what to re-read."""

from trainguard.streams import transport


def test_every_overridden_upstream_function_is_the_one_the_override_follows():
    changed = transport.changed_upstream()
    assert changed == [], (
        f"upstream changed: {changed}. Re-read each against streams/transport.py (and streams/app.py's "
        f"_Worker), adapt the override, then record the new hash with transport.source_hash(path).")


def test_a_changed_function_is_named(monkeypatch):
    monkeypatch.setitem(transport.UPSTREAM, "faust.app.base:App._new_transport", "0" * 16)
    monkeypatch.setitem(transport.UPSTREAM, "faust.nowhere:Gone.method", "0" * 16)
    assert transport.changed_upstream() == ["faust.app.base:App._new_transport", "faust.nowhere:Gone.method"]
