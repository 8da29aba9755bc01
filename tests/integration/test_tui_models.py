"""The console's models panel (tui/models_panel.py) on a whole in-process daemon: it lists the
loaded model and the store's, `enter` loads the selected one, `u` + `y` unloads it; the
answers go to the event log (docs/models.md, docs/console.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon_helpers import async_wait_until
from mlxcel.daemon.models.pull import pull
from mlxcel.shared.control_client import ControlClient
from mlxcel.tui.models_panel import ModelsScreen, model_rows
from mlxcel.tui.screens import ConfirmScreen
from textual.app import App
from textual.widgets import DataTable


class PanelApp(App[None]):
    def __init__(self, client: ControlClient) -> None:
        super().__init__()
        self.client = client
        self.reports: list[str] = []

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        return await self.client.call(method, params, timeout=60)

    def on_mount(self) -> None:
        self.push_screen(ModelsScreen(self.call, lambda text, _style: self.reports.append(text)))


def test_rows_put_loaded_models_first() -> None:
    listing = {
        "keep_alive_s": 300.0,
        "models": [
            {"name": "a", "state": "loaded", "family": "llama", "weights_bytes": 2 << 20,
             "load_s": 1.25, "active_requests": 0, "expires_in_s": 42.4,
             "forward": "weights 4-bit g32 · decode native quantized"},
        ],
        "available": [
            {"name": "a", "family": "llama", "size_bytes": 3 << 20},
            {"name": "b", "family": "qwen2", "size_bytes": 1 << 30},
        ],
    }  # fmt: skip
    rows = model_rows(listing)
    assert [name for name, _ in rows] == ["a", "b"]
    assert rows[0][1][:2] == ("a", "loaded") and rows[0][1][4:] == (
        "1.2 s",
        "0",
        "42 s",
        "weights 4-bit g32 · decode native quantized",
    )
    assert rows[1][1][:3] == ("b", "on disk", "qwen2") and "GiB" in rows[1][1][3]


async def test_the_panel_loads_and_unloads(
    mlxcel_home: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from embedded import EmbeddedDaemon, paths_under
    from mlxcel.daemon.models.tiny import make_tiny_model
    from mlxcel.shared.config import ServingConfig

    pull(str(make_tiny_model(tmp_path / "b", seed=1)), name="tiny-b", progress=None)
    paths = paths_under(mlxcel_home)
    cfg = ServingConfig(model=str(tiny_model_dir), port=0)
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as daemon:
        client = ControlClient(daemon.socket_path)
        await client.connect()
        app = PanelApp(client)
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                screen = app.screen
                assert isinstance(screen, ModelsScreen)
                table = screen.query_one("#models-table", DataTable)
                await async_wait_until(lambda: "tiny-b" in table.rows, what="tiny-b listed")
                loaded = [
                    str(k.value) for k in table.rows if table.get_cell(k, "state") == "loaded"
                ]
                assert loaded == [str(tiny_model_dir)]
                assert table.get_cell("tiny-b", "state") == "on disk"
                table.move_cursor(row=table.get_row_index("tiny-b"))
                await pilot.press("enter")
                await async_wait_until(
                    lambda: "loaded tiny-b" in " ".join(app.reports), 60, what=str(app.reports)
                )
                await async_wait_until(lambda: table.get_cell("tiny-b", "state") == "loaded")
                table.move_cursor(row=table.get_row_index("tiny-b"))
                await pilot.press("u")
                await async_wait_until(lambda: isinstance(app.screen, ConfirmScreen))
                await pilot.press("y")
                await async_wait_until(lambda: "unloaded tiny-b" in app.reports, 60)
                listing = await client.call("model.list", {})
                assert listing["models"] == [] and listing["unloads"] == 2
        finally:
            await client.close()


async def test_m_opens_the_panel_in_mlxcel_top(mlxcel_home: Path, tiny_model_dir: Path) -> None:
    from embedded import EmbeddedDaemon, paths_under
    from mlxcel.shared.config import ServingConfig
    from mlxcel.tui.app import make_app
    from mlxcel.tui.state import Link

    paths = paths_under(mlxcel_home)
    cfg = ServingConfig(model=str(tiny_model_dir), port=0)
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as daemon:
        app = make_app(daemon.socket_path, retry_s=0.1)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: app.link_state.link is Link.CONNECTED, 30)
            await pilot.press("m")
            await async_wait_until(lambda: isinstance(app.screen, ModelsScreen))
            table = app.screen.query_one("#models-table", DataTable)
            await async_wait_until(lambda: str(tiny_model_dir) in table.rows)
            assert table.get_cell(str(tiny_model_dir), "state") == "loaded"
            await pilot.press("escape")
            await async_wait_until(lambda: not isinstance(app.screen, ModelsScreen))


async def test_p_pins_and_unpins_the_selected_model(
    mlxcel_home: Path, tiny_model_dir: Path
) -> None:
    from embedded import EmbeddedDaemon, paths_under
    from mlxcel.shared.config import ServingConfig

    paths = paths_under(mlxcel_home)
    cfg = ServingConfig(model=str(tiny_model_dir), port=0)
    name = str(tiny_model_dir)
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as daemon:
        client = ControlClient(daemon.socket_path)
        await client.connect()
        app = PanelApp(client)
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                table = app.screen.query_one("#models-table", DataTable)
                await async_wait_until(lambda: name in table.rows, what="the model listed")
                table.move_cursor(row=table.get_row_index(name))
                await pilot.press("p")
                await async_wait_until(lambda: f"pinned {name}" in app.reports, 30)
                await async_wait_until(lambda: table.get_cell(name, "state") == "loaded, pinned")
                assert table.get_cell(name, "unloads in") == "never"
                (entry,) = (await client.call("model.list", {}))["models"]
                assert entry["pinned"] is True
                table.move_cursor(row=table.get_row_index(name))
                await pilot.press("p")
                await async_wait_until(lambda: f"unpinned {name}" in app.reports, 30)
                await async_wait_until(lambda: table.get_cell(name, "state") == "loaded")
        finally:
            await client.close()
