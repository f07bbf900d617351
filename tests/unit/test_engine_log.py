import subprocess
import sys
import textwrap


def test_children_and_libraries_write_to_the_log_and_the_screen_gets_only_results(tmp_path):
    # Run in a child so that this test's own descriptors (pytest's capture) are not touched.
    log = tmp_path / "logs" / "demo.log"
    program = textwrap.dedent(
        f"""
        import os, subprocess, sys
        from pathlib import Path
        from vllm_specstream.bench.engine_log import output_to

        print("before", flush=True)
        with output_to(Path({str(log)!r})) as screen:
            print("python stdout")
            print("python stderr", file=sys.stderr)
            os.write(1, b"fd one\\n")  # what C++ libraries do
            subprocess.run([sys.executable, "-c", "import sys; print('child'); "
                            "print('child err', file=sys.stderr)"], check=True)
            screen.write("result line\\n")
        print("after", flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.splitlines() == ["before", "result line", "after"]
    assert out.stderr == ""
    logged = log.read_text().splitlines()
    for line in ("python stdout", "python stderr", "fd one", "child", "child err"):
        assert line in logged
    assert "result line" not in logged
