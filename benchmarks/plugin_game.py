"""The godot_rl baseline's game: clients/plugin_emulator.py unchanged, with its bytes counted.

    python -m benchmarks.plugin_game --port=P --policies=p0:400:continuous --obs_size=64 --fast ...

Takes the emulator's own ``--key=value`` arguments (as a game launched by godot_rl would).
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.counting import CountingSocket, WireReport
from clients.plugin_emulator import PluginEmulator, config_from_args


class CountedEmulator(PluginEmulator):
    report: WireReport | None = None

    def send(self, message: dict[str, Any]) -> None:
        super().send(message)
        if self.report is not None and message.get("type") == "step":
            self.report.tick()


def main() -> None:
    emulator = CountedEmulator(config_from_args(sys.argv[1:]))
    emulator.connect(timeout=120)
    assert emulator.sock is not None
    counter = CountingSocket(emulator.sock)
    emulator.sock = counter  # type: ignore[assignment]
    emulator.report = WireReport(counter)
    try:
        emulator.run()
    except ConnectionError:
        pass  # the trainer stopped: the benchmark is over
    finally:
        emulator.close()


if __name__ == "__main__":
    main()
