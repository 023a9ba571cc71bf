"""Headless Chromium driven over the Chrome DevTools protocol (the dashboard tests), and the
learner metrics they plot."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import subprocess

from rlstream.broker import Reporter

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
    """A minimal CDP client over one page's websocket."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params):
        mid = next(self.ids)
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    async def eval(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                state = await self.eval("JSON.stringify(window.rlstream || null)")
                raise AssertionError(f"timed out waiting for {expression}; window.rlstream = {state}")
            await asyncio.sleep(0.2)


async def devtools_port(profile, proc: subprocess.Popen, timeout: float = 30.0) -> int:
    path = profile / "DevToolsActivePort"
    for _ in range(int(timeout / 0.1)):
        if path.exists() and path.read_text().strip():
            return int(path.read_text().splitlines()[0])
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode}")
        await asyncio.sleep(0.1)
    raise AssertionError("chromium did not open its DevTools port")


async def emit_steps(reporter: Reporter, steps: range) -> None:
    for step in steps:
        # reward climbs 0.1 per step; KL, loss, staleness, depth follow simple rules of the step
        await reporter.emit({"reward/mean": 0.1 * step, "policy/kl": 0.01 * step, "loss/total": 1.0 / step,
                             "buffer/staleness_max": float(step % 3), "buffer/depth": float(10 + step)}, step=step)
