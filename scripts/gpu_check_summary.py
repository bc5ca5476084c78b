"""Prints the summary table of scripts/gpu-check (or gpu-check-multi) from its
output folder: test counts from the JUnit files of ctest and pytest, the
benchmark rows, the soak workload (in the benchmark file or soak.json) and the
compute-sanitizer runs (sanitize.json): ``gpu_check_summary.py OUT [--bench
h200.json] [--logs LOGS]`` (LOGS: where gpu-check wrote its JUnit files and
the tier's wall time; OUT by default)."""

import json
import os
import sys
import xml.etree.ElementTree as ElementTree


def junit_counts(path):
    if not os.path.exists(path):
        return None
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = skipped = 0
    for suite in suites:
        for case in suite.iter("testcase"):
            total += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is not None:
                skipped += 1
    return total - failed - skipped, failed, skipped


def soak_rows(workload):
    """Rows of the soak workload (bench/soak.py): one per API."""
    verdict = "all checks passed" if workload.get("ok") else "CHECKS FAILED"
    print(f"\nsoak: {workload['replays_per_api']} replays per API, {verdict} (memory growth "
          f"<= {workload['growth_limit_mb']} MB, diff <= {workload['diff_limit']})\n")
    print("| api | replays | us/replay | alloc growth MB | reserved growth MB | max diff | ok |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for api, r in workload["apis"].items():
        if "error" in r:
            print(f"| {api} | FAILED: {r['error'].strip().splitlines()[-1]} | | | | | no |")
            continue
        if "evictions" in r:
            api += (f" (evictions {r['evictions']}, graphs <= {r['graphs_max']}, "
                    f"within budget: {r['within_budget']})")
        print(f"| {api} | {r['replays']} | {r['us_per_replay']} | {r['allocated_growth_mb']} | "
              f"{r['reserved_growth_mb']} | {r['max_abs_diff_vs_eager']:.2e} | "
              f"{'yes' if r['ok'] else 'NO'} |")


def sanitize_rows(out):
    """Rows of scripts/gpu_sanitize.py's sanitize.json, when it ran."""
    path = os.path.join(out, "sanitize.json")
    if not os.path.exists(path):
        return
    with open(path) as file:
        result = json.load(file)
    if "error" in result:
        print(f"\nsanitize: not run: {result['error']}")
        return
    print("\n| sanitizer | tests | errors |")
    print("|---|---|---:|")
    for tool in result["tools"].values():
        errors = tool["errors"] if tool["complete"] else f"{tool['errors']} (INCOMPLETE)"
        print(f"| {tool['tool']} | {'; '.join(tool['tests'])} | {errors} |")


def main(out, bench_name="h200.json", logs=None):
    """The summary of gpu-check's output folder; JUnit files and the tier's
    wall time are read from ``logs`` (gpu-check's log folder) when given."""
    logs = logs or out
    print("\n## gpu-check summary\n")
    print("| tests | passed | failed | skipped |")
    print("|---|---:|---:|---:|")
    for name, files in (("C++ (ctest)", ("ctest.xml", "ctest-exclusive.xml")),
                        ("Python (pytest)", ("pytest.xml", "pytest-exclusive.xml"))):
        found = [c for c in (junit_counts(os.path.join(logs, f)) for f in files) if c is not None]
        if not found:
            print(f"| {name} | not run | | |")
        else:
            passed, failed, skipped = (sum(c[i] for c in found) for i in range(3))
            print(f"| {name} | {passed} | {failed} | {skipped} |")
    wall = os.path.join(logs, "tests_wall.txt")
    if os.path.exists(wall):
        with open(wall) as file:
            print(f"\nGPU tier wall time: {file.read().strip()} s (build excluded)")
    sanitize_rows(out)
    soak = os.path.join(out, "soak.json")
    if bench_name != "soak.json" and os.path.exists(soak):
        with open(soak) as file:
            for workload in json.load(file)["workloads"].values():
                if "apis" in workload:
                    soak_rows(workload)
    bench = os.path.join(out, bench_name)
    if not os.path.exists(bench):
        print("\nbenchmarks: not run")
        return
    with open(bench) as file:
        results = json.load(file)
    print(f"\nbenchmarks on {results['device']}, torch {results['torch']}\n")
    print("| workload | method | ms | x floor | x eager | capture ms | graph MB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for workload, data in results["workloads"].items():
        if "error" in data:
            print(f"| {workload} | FAILED: {data['error'].strip().splitlines()[-1]} | | | | | |")
            continue
        if "apis" in data:
            print(f"| {workload} | see the soak table | | | | | |")
            continue
        if workload in ("hf_decode_models", "hf_serving"):
            print(f"| {workload} | see the {workload} table | | | | | |")
            continue
        if "models" in data:
            print(f"| {workload} | see the zoo tables | | | | | |")
            continue
        if workload == "auto_overhead":
            print(f"| {workload} | see its table | | | | | |")
            continue
        if "host_us" in data:
            for case, us in data["host_us"].items():
                print(f"| {workload} | {case} | {us:.2f} us host | | | | |")
            continue
        if isinstance(data.get("kernel_floor_ms"), dict):
            print(f"| {workload} | see the hf_decode table | | | | | |")
            continue
        if workload == "integrations":
            for method, r in data["methods"].items():
                ms = "failed" if "error" in r else f"{r['ms']:.4f}"
                speed = r.get("speedup_vs_framework", "")
                print(f"| {workload} | {method} | {ms} | | {speed} (x framework) | | |")
            continue
        if "kernel_floor_ms" in data:
            print(f"| {workload} | kernel floor | {data['kernel_floor_ms']:.4f} | 1.00 | | | |")
        for method, r in data["methods"].items():
            floor = f"{r['ratio_to_floor']:.2f}" if "ratio_to_floor" in r else ""
            print(f"| {workload} | {method} | {r['ms']:.4f} | {floor} | "
                  f"{r['speedup_vs_eager']:.2f} | {r.get('capture_ms', '')} | "
                  f"{r.get('graph_mb', '')} |")
    for workload, data in results["workloads"].items():
        if "apis" in data:
            soak_rows(data)
        if workload == "hf_decode_models" and "error" not in data:
            print()
            print(_hf_decode_models_markdown(data))
        elif workload == "hf_serving" and "error" not in data:
            print()
            print(_hf_serving_markdown(data))
        elif "models" in data and "steps" in data:  # zoo_modern
            print()
            print(_zoo_modern_markdown(data))
        elif "models" in data:
            print()
            print(_zoo_markdown(data))
        if isinstance(data.get("kernel_floor_ms"), dict):
            print()
            print(_hf_decode_markdown(data))
        if "all_blocked_ratio" in data:
            print()
            print(_auto_overhead_markdown(data))
    if results.get("advice"):
        print("\n| advice | predicted ms | measured ms | error |")
        print("|---|---:|---:|---:|")
        for workload, entry in results["advice"].items():
            if "error" in entry:
                print(f"| {workload} | FAILED: {entry['error'].strip().splitlines()[-1]} | | |")
            else:
                print(f"| {workload} ({entry['method']}) | {entry['predicted_ms']:.4f} | "
                      f"{entry['measured_ms']:.4f} | {100 * entry['rel_error']:+.1f}% |")


def _hf_decode_markdown(data):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import hf_decode_report  # without importing graphed or torch

    return "\n".join(hf_decode_report.markdown(data))


def _hf_decode_models_markdown(data):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import hf_decode_report  # without importing graphed or torch

    return "\n".join(hf_decode_report.models_markdown(data))


def _hf_serving_markdown(data):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import hf_decode_report  # without importing graphed or torch

    return "\n".join(hf_decode_report.serving_markdown(data))


def _auto_overhead_markdown(data):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import auto_overhead

    return "\n".join(auto_overhead.markdown(data))


def _zoo_modern_markdown(data):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import zoo_modern

    return "\n".join(zoo_modern.markdown(data))


def _zoo_markdown(data):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import zoo_report  # bench/zoo.py's tables, without importing graphed

    return zoo_report.markdown(data)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    options = {"--bench": "h200.json", "--logs": None}
    for flag in options:
        if flag in arguments:
            at = arguments.index(flag)
            options[flag] = arguments[at + 1]
            del arguments[at:at + 2]
    main(arguments[0] if arguments else "build/gpu-check", options["--bench"], options["--logs"])
