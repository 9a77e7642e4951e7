"""qerl/plotting.py: a run's metrics.jsonl drawn as reward, entropy and AQN sigma over steps."""

import json

import pytest
from matplotlib.figure import Figure

from qerl import plotting


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures plot_metrics saves, kept for inspection (savefig still writes the file)."""
    figures = []
    save = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _metrics(path, sigmas):
    rows = [
        {"step": i + 1, "loss": 0.0, "reward": 0.1 * i, "entropy": 0.5, "aqn/sigma": s} for i, s in enumerate(sigmas)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sigma_is_drawn_on_a_log_scale_so_its_late_stages_show(tmp_path, saved_figures):
    # AQN's stages fall geometrically, 1e-2 -> 1e-4, after a first stage without noise: on a linear axis the last
    # five would sit on zero.
    sigmas = [0.0] * 3 + [1e-2 * (1e-2) ** (k / 9) for k in range(10) for _ in range(3)]
    png = plotting.plot_metrics(_metrics(tmp_path / "m.jsonl", sigmas), tmp_path / "m.png", title="t")
    (figure,) = saved_figures
    reward, entropy, sigma = figure.axes
    assert sigma.get_yscale() == "symlog" and reward.get_yscale() == "linear"
    low, high = sigma.get_ylim()
    assert low <= 1e-4 and high >= 1e-2
    assert (tmp_path / "m.png").stat().st_size > 10_000 and png == tmp_path / "m.png"


def test_sigma_without_noise_stays_linear(tmp_path, saved_figures):
    plotting.plot_metrics(_metrics(tmp_path / "m.jsonl", [0.0] * 12), tmp_path / "m.png")
    assert saved_figures[0].axes[2].get_yscale() == "linear"
