"""The command line's signal delivery (voxtral_mlx.interrupts): an interrupt is raised
where the CLI can clean up, never lost, never twice, never in the middle of an import."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import pytest

from voxtral_mlx.interrupts import Terminated, catching_termination, signals_held

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="POSIX signals")


def _wait_for_interrupt(seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)


class _SignalsWhenCollected:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_an_interrupt_during_a_del_is_raised_after_it():
    """Raised inside __del__, Python printed it as "ignored" and the run went on."""
    with pytest.raises(KeyboardInterrupt), catching_termination():
        obj = _SignalsWhenCollected()
        del obj
        _wait_for_interrupt()


def test_an_interrupt_during_a_weakref_callback_is_raised_after_it(capsys):
    """A callback in no module known to be unsafe: the swallowed interrupt comes back
    through sys.unraisablehook."""

    class Target:
        pass

    target = Target()
    ref = weakref.ref(target, lambda _: signal.raise_signal(signal.SIGTERM))
    with pytest.raises(Terminated), catching_termination():
        del target
        gc.collect()
        _wait_for_interrupt()
    assert ref() is None
    assert "Exception ignored" not in capsys.readouterr().err


def test_an_interrupt_during_an_import_waits_for_the_import(tmp_path, monkeypatch):
    """Cut in half, a module stays broken (numpy then refused to import at all)."""
    (tmp_path / "half_imported_vx.py").write_text(
        "import signal\nsignal.raise_signal(signal.SIGINT)\nCOMPLETE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt), catching_termination():
        import half_imported_vx  # noqa: F401

        _wait_for_interrupt()
    assert sys.modules["half_imported_vx"].COMPLETE
    del sys.modules["half_imported_vx"]


def test_a_second_interrupt_during_the_clean_up_is_dropped():
    """A double Ctrl-C cut the clean-up short (a lock released twice, a temp file left)."""
    cleaned = False
    with pytest.raises(KeyboardInterrupt) as first, catching_termination():
        try:
            signal.raise_signal(signal.SIGINT)
            _wait_for_interrupt()
        finally:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.05)
            cleaned = True
    assert cleaned and type(first.value) is KeyboardInterrupt


def test_signals_held_raises_at_the_end_of_the_block():
    done = []
    with pytest.raises(Terminated), catching_termination():
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            done.append("after the signal")
        done.append("never")
    assert done == ["after the signal"]


def test_handlers_and_hook_are_restored():
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM))
    hook = sys.unraisablehook
    with catching_termination():
        assert signal.getsignal(signal.SIGINT) is not before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)) == before
    assert sys.unraisablehook is hook
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


def test_an_interrupt_long_after_the_first_ends_the_process():
    """If the clean-up hangs, insisting ends the process the signal's default way."""
    proc = _child(
        """
        import signal, time
        from voxtral_mlx import interrupts
        interrupts.FORCE_AFTER_S = 0.1
        try:
            with interrupts.catching_termination():
                try:
                    signal.raise_signal(signal.SIGINT)
                    time.sleep(1)
                finally:
                    time.sleep(0.2)  # a clean-up that takes long
                    signal.raise_signal(signal.SIGINT)
                    time.sleep(1)
                    print("not reached")
        except KeyboardInterrupt:
            print("not reached either")
        """
    )
    assert proc.returncode == -signal.SIGINT and "reached" not in proc.stdout, proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_outside_a_command_a_signal_ends_the_process_in_one_line(sig):
    proc = _child(
        f"""
        import signal, sys
        from voxtral_mlx.interrupts import exit_on_signals
        exit_on_signals("voxtral-mlx: error: interrupted")
        sys.stdout.write("flushed first")
        signal.raise_signal({int(sig)})
        print("not reached")
        """
    )
    assert proc.returncode == 128 + sig
    assert proc.stderr == "voxtral-mlx: error: interrupted\n"
    assert proc.stdout == "flushed first"


def test_a_command_takes_over_from_exit_on_signals():
    proc = _child(
        """
        import signal
        from voxtral_mlx.interrupts import catching_termination, exit_on_signals
        exit_on_signals("ended at once")
        try:
            with catching_termination():
                signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            print("cleaned up")
        """
    )
    assert proc.returncode == 0 and proc.stdout == "cleaned up\n", proc


def test_a_signal_as_a_finished_command_hands_back_its_handlers_says_it_had_finished():
    """Restoring the handlers a command took over (Python runs a pending signal's handler
    inside each ``signal.signal``) used to give a signal arriving then start-up's "error:
    interrupted", exit 130, for a conversion that was complete (the caller installs its
    "after the command had finished" handler only once the command has returned)."""
    proc = _child(
        """
        import signal
        from voxtral_mlx import interrupts
        interrupts.exit_on_signals("voxtral-mlx: error: interrupted")
        real_signal = signal.signal
        def restoring(sig, handler):  # a signal comes in while the handlers are put back
            real_signal(sig, handler)
            if sig == signal.SIGINT and handler in interrupts._QUICK_EXITS:
                signal.raise_signal(signal.SIGINT)
        with interrupts.catching_termination():
            signal.signal = restoring
            interrupts.hold_from_now()
        print("not reached")
        """
    )
    assert proc.returncode == 128 + signal.SIGINT and "reached" not in proc.stdout, proc
    assert proc.stderr == "voxtral-mlx: error: interrupted after the command had finished\n"
