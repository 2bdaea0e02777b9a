"""``python -m sglang_rimuru.launch_server``: SGLang's HTTP server with rimuru.

Takes every SGLang flag unchanged plus the project's ``--rimuru-*`` flags.
Spawned SGLang processes import this module as ``__mp_main__``; the bootstrap
call below is what installs the project's patches there.
"""

from rimuru_patches.bootstrap import bootstrap_process

bootstrap_process(announce=__name__ == "__mp_main__")


def main(argv: "list[str] | None" = None) -> int:
    from rimuru_patches.server import main as serve

    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main())
