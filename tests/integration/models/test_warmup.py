"""SFT warm-up: produces a loadable HF checkpoint, lowers the loss, and is cached.

The tests of this subject that start processes or engines; the rest are in tests/unit/models/test_warmup.py.
"""



def test_two_processes_needing_one_cached_model_build_it_once(tmp_path):
    """Two jobs (or two pytest-xdist workers) that start together and need the same warm-up used to both
    train it, each at half the CPU, and the later rename lost; now the second waits for the first's
    result (a lock on the cache directory) and builds nothing."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from megatron_specrl.models.cache import build_once
        def build(tmp):
            with open({str(tmp_path / 'builds.log')!r}, 'a') as f:
                f.write(f'{{os.getpid()}}\\n')
            time.sleep(1.5)                     # long enough for the other process to arrive meanwhile
            (tmp / 'model.bin').write_text('weights')
            (tmp / 'done').write_text('')
        out = build_once(Path({str(tmp_path / 'cache' / 'warmup-x')!r}), 'done', build)
        print(out, (out / 'model.bin').read_text())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert [out.split() for out, _ in results] == [[str(tmp_path / "cache" / "warmup-x"), "weights"]] * 2
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1        # built once, reused once
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["warmup-x"]    # no temp dir, no lock file


