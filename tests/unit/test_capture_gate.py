"""The gate between CUDA graph captures and other calls (opfuse.runtime.gate): a capture waits for the calls in
flight and holds back new ones; calls share it; a capturing thread may call; a calling thread cannot capture."""

import threading

import pytest

from opfuse.runtime.gate import CaptureGate


def in_thread(gate: CaptureGate, mode: str, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def body():
        with getattr(gate, mode)():
            entered.set()
            leave.wait(10)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("first, second", [("shared", "exclusive"), ("exclusive", "shared"),
                                           ("exclusive", "exclusive")])
def test_a_capture_and_a_call_never_hold_the_gate_at_once(first, second):
    gate = CaptureGate()
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    one = in_thread(gate, first, entered[0], leave[0])
    assert entered[0].wait(10)
    two = in_thread(gate, second, entered[1], leave[1])
    assert not entered[1].wait(0.3), f"{second} entered while another thread held the gate {first}"
    leave[0].set()
    assert entered[1].wait(10), f"{second} never entered after {first} left"
    leave[1].set()
    one.join(10), two.join(10)


def test_calls_share_the_gate():
    gate = CaptureGate()
    entered = [threading.Event(), threading.Event()]
    leave = threading.Event()
    threads = [in_thread(gate, "shared", event, leave) for event in entered]
    assert all(event.wait(10) for event in entered)
    leave.set()
    for thread in threads:
        thread.join(10)


def test_a_capturing_thread_may_call_but_a_calling_thread_may_not_capture():
    gate = CaptureGate()
    with gate.exclusive(), gate.shared(), gate.exclusive():
        pass
    with gate.shared():
        with pytest.raises(RuntimeError, match="wait for itself"):
            with gate.exclusive():
                pass
    entered, leave = threading.Event(), threading.Event()
    leave.set()
    in_thread(gate, "exclusive", entered, leave).join(10)      # all released: another thread gets it
    assert entered.is_set()
