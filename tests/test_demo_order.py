"""The demo's console: lines from three topics and the trainer's thread come out in time order."""

import time

from trainguard.demo import TimeOrdered


def test_lines_wait_for_older_ones_still_in_flight_then_come_out_by_time():
    ordered = TimeOrdered(hold_s=0.2)
    shown = []
    ordered.put(30.0, lambda: shown.append("ack"))
    ordered.put(10.0, lambda: shown.append("command"))
    ordered.release()
    assert shown == [], "nothing is shown before it has waited for older lines"
    ordered.put(20.0, lambda: shown.append("report"))  # arrives late, belongs in the middle
    time.sleep(0.25)
    ordered.release()
    assert shown == ["command", "report", "ack"]


def test_everything_left_comes_out_at_the_end():
    ordered = TimeOrdered(hold_s=60)
    shown = []
    ordered.put(2.0, lambda: shown.append("b"))
    ordered.put(1.0, lambda: shown.append("a"))
    ordered.release(everything=True)
    assert shown == ["a", "b"]
