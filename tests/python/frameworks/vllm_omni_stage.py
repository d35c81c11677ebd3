"""One vLLM-Omni process, run by test_frameworks.py with the real vLLM-Omni 0.30.0 on its path.
It imports nothing of stagelink: vLLM-Omni's plugin loader finds stagelink's entry point, and the
pipeline YAML names the connectors.

    vllm_omni_stage.py send CONFIG FROM TO     orchestrator: try_send_via_connector, prints the
                                               notification (pickle, hex) and waits for a line
    vllm_omni_stage.py recv CONFIG STAGE       stage worker: reads the notification from stdin,
                                               try_recv_via_connector, prints the inputs (pickle, hex)
"""
import pickle
import sys
import time

# Sent and compared as the framework carries them: token ids, a hidden-state array, a prompt.
PAYLOAD = {"prompt_token_ids": list(range(100)), "text": "the thinker's words"}


def inputs():
    import numpy as np
    return dict(PAYLOAD, hidden=np.arange(4096 * 16, dtype=np.float32).reshape(16, 4096))


def say(line, **_):
    """A line for the test (frameworks log to stdout too: the test reads only these)."""
    sys.stdout.write(f"@@ {line}\n")
    sys.stdout.flush()


def main():
    from vllm_omni.plugins import load_omni_general_plugins
    load_omni_general_plugins()
    from vllm_omni.distributed.omni_connectors.adapter import try_recv_via_connector, try_send_via_connector
    from vllm_omni.distributed.omni_connectors.utils.initialization import (
        build_stage_connectors, get_stage_connector_config, initialize_orchestrator_connectors,
        load_omni_transfer_config)
    from vllm_omni.metrics import OrchestratorAggregator

    role, config = sys.argv[1], sys.argv[2]
    if role == "send":
        src, dst = int(sys.argv[3]), int(sys.argv[4])
        _, connectors = initialize_orchestrator_connectors(config)
        connector = connectors[(str(src), str(dst))]
        notes = []
        metrics = OrchestratorAggregator(num_stages=dst + 1, log_stats=False, wall_start_ts=time.time(),
                                         final_stage_id_for_e2e=dst)
        ok = try_send_via_connector(connector, src, dst, "req-1", inputs(), {"temperature": 0.5},
                                    {"prompt": "hi"}, notes.append, metrics)
        say(type(connector).__module__ + "." + type(connector).__name__)
        say(pickle.dumps((ok, notes)).hex())
        sys.stdin.readline()  # the receiver has read it
        connector.close()
    else:
        stage = int(sys.argv[3])
        connectors = build_stage_connectors(stage, get_stage_connector_config(load_omni_transfer_config(config), stage))
        task = pickle.loads(bytes.fromhex(sys.stdin.readline().strip()))
        got, rx = try_recv_via_connector(task, connectors, stage)
        say(",".join(sorted(f"{k[0]}->{k[1]}:{type(c).__module__}.{type(c).__name__}" for k, c in connectors.items())))
        say(pickle.dumps((got, rx)).hex())
        for c in connectors.values():
            c.close()


if __name__ == "__main__":
    assert "stagelink" not in sys.modules
    main()
