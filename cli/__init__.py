"""`gpu-dra`, the operator's command line (`__main__.main`); one module per subcommand.

See docs/config.md#gpu-dra.
"""
