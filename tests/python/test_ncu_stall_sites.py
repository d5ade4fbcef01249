"""scripts/ncu_stall_sites.py, the profiling script that ranks a kernel's SASS instructions by
their share of ncu's warp-stall samples: it splits ncu's source page into its kernels, ranks
each kernel's instructions, sums the stall reasons, and says so when the page has no samples."""

from __future__ import annotations

from repo_scripts import load_script


PAGE = """\
"Kernel Name","gemm_kernel<0>"
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier"
"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9+0x34000], R20","1,200","1000","1100","0"
"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x1","300","290","0","300"
"0x30","NOP","0","0","0","0"
"Kernel Name","gemm_kernel<1>"
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier"
"0x40","LDG.E R2, [R4]","50","40","50","0"
"""


def run(tmp_path, monkeypatch, capsys, text):
    page = tmp_path / "source.csv"
    page.write_text(text)
    monkeypatch.setattr("sys.argv", ["ncu_stall_sites.py", str(page), "--top", "5"])
    status = load_script("ncu_stall_sites").main()
    return status, capsys.readouterr().out


def test_ranks_each_kernels_instructions(tmp_path, monkeypatch, capsys):
    status, out = run(tmp_path, monkeypatch, capsys, PAGE)
    assert status == 0
    first, second = out.split("== Kernel Name gemm_kernel<1>")
    assert "gemm_kernel<0>" in first and "1500 samples" in first
    assert "stall_long_sb 73.3%" in first and "stall_barrier 20.0%" in first
    wait = first.index("TRYWAIT")
    depbar = first.index("DEPBAR")
    assert wait < depbar  # ranked by samples: 80% before 20%
    assert " 80.0%" in first and "long_sb=92%" in first
    assert "NOP" not in first  # instructions without samples are left out
    assert "50 samples" in second and "100.0%" in second and "LDG.E" in second


def test_lists_a_repeated_kernel_once(tmp_path, monkeypatch, capsys):
    first_kernel = PAGE.split('"Kernel Name","gemm_kernel<1>"')[0]
    status, out = run(tmp_path, monkeypatch, capsys, first_kernel + first_kernel)
    assert status == 0
    assert out.count("== Kernel Name gemm_kernel<0>") == 1


def test_says_when_the_page_has_no_samples(tmp_path, monkeypatch, capsys):
    status, out = run(tmp_path, monkeypatch, capsys, '"ID","Name"\n"1","kernel"\n')
    assert status == 1
    assert "no source block" in out
