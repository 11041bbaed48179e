"""The compiled FLOPs per token of the serve engine's training pass with 1 and 16 adapter slots
(llama3-tiny, rank 32, 16 rows x 256 tokens, v5p-8): the adapter axis must not multiply the base's
work. Needs podtrain[aot]."""

from podtrain.orchestrator.plan.platforms import start_jax


def main() -> None:
    start_jax(compile_only=True)
    from podtrain.launch.serve import serve_config
    from podtrain.orchestrator.plan.serve_plan import plan_serve_on_target
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    target = parse_target("v5p-8")
    devices = compile_devices(target)
    flops = {}
    for slots in (1, 16):
        config, _ = serve_config("llama3-tiny", [f"serve.max_adapters={slots}", "serve.max_rank=32",
                                                 "serve.max_seq_len=256", "serve.max_rows=16"])
        report = plan_serve_on_target(config, target, devices, programs=("forward_backward",))
        flops[slots] = report["programs"]["forward_backward"]["flops_per_token"]
        print(f"{slots:>2} adapter slots: {flops[slots]:,.0f} FLOPs per token", flush=True)
    print(f"16 / 1: {flops[16] / flops[1]:.4f}")


if __name__ == "__main__":
    main()
