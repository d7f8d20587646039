"""jaxcomp.cli._report: the progress bar, tables and plot-path checks the commands share."""

import builtins
import os

from jaxcomp.cli import _report


def test_a_disabled_bar_iterates_and_prints_nothing(capsys):
    bar = _report.progress_bar(range(3), enabled=False)
    assert list(bar) == [0, 1, 2]
    bar.set_description("cell 1")
    bar.update(1)
    bar.close()
    assert capsys.readouterr().err == ""


def test_without_tqdm_the_bar_prints_its_descriptions(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    bar = _report.progress_bar(total=2, unit="cell")
    bar.set_description("mlp, 2 hosts, 1gbit")
    assert list(_report.progress_bar(range(2))) == [0, 1]
    assert capsys.readouterr().err == "mlp, 2 hosts, 1gbit\n"


def test_markdown_and_text_tables():
    rows = [["1", "top_k"], ["22", "zfp"]]
    assert _report.format_table(["n", "op"], rows, align="rl").splitlines() == [
        "| n | op |",
        "|---:|---|",
        "| 1 | top_k |",
        "| 22 | zfp |",
    ]
    assert _report.format_table(["n", "op"], rows, markdown=False).splitlines() == [
        "n   op",
        "--  -----",
        "1   top_k",
        "22  zfp",
    ]


def test_plot_paths_are_checked_before_any_work(tmp_path):
    assert _report.unwritable_file(str(tmp_path / "a.png"), ("png",)) is None
    assert "is a folder" in _report.unwritable_file(str(tmp_path))
    assert "does not exist" in _report.unwritable_file(str(tmp_path / "no" / "a.png"))
    assert "must end in one of .png" in _report.unwritable_file(str(tmp_path / "a.txt"), ("png",))
    assert _report.unwritable_file(str(tmp_path / "rows.json")) is None
    (tmp_path / "file").write_text("")
    assert _report.unwritable_folder(str(tmp_path / "file")) == "exists and is not a folder"
    assert _report.unwritable_folder(str(tmp_path / "new")) is None
    assert os.path.isdir(tmp_path / "new")


def test_save_figure_writes_the_image(tmp_path):
    figure, axes = _report.pyplot().subplots()
    axes.plot([1, 2], [3, 4])
    _report.save_figure(figure, str(tmp_path / "p.png"), dpi=50)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_distinct_styles_differ_in_colour_style_and_marker():
    styles = _report.distinct_styles(9)
    for key in ("color", "linestyle", "marker"):
        assert all(a[key] != b[key] for a, b in zip(styles, styles[1:])), key
    assert len({s["color"] for s in styles}) == 9  # the panels of the demo have at most 6 lines
    assert "black" not in {s["color"] for s in styles}  # black is the reference's


def test_log_ticks_are_plain_numbers_at_1_2_5(tmp_path):
    figure, axes = _report.pyplot().subplots()
    axes.plot([0, 1], [0.07, 3.0])
    axes.set_yscale("log")
    _report.log_ticks_1_2_5(axes.yaxis)
    figure.canvas.draw()
    low, high = axes.get_ylim()
    labels = [
        t.get_text() for t, v in zip(axes.get_yticklabels(), axes.get_yticks()) if low <= v <= high
    ]
    assert labels == ["0.1", "0.2", "0.5", "1", "2"]
    _report.pyplot().close(figure)


def test_csv_quotes_cells_with_commas(tmp_path):
    path = tmp_path / "t.csv"
    _report.write_csv(path, ["run", "note"], [["a", "x, y"], ["b", 1.5]])
    assert path.read_text().splitlines() == ["run,note", 'a,"x, y"', "b,1.5"]
