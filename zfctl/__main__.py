"""`python -m zfctl`: the same as the `zfctl` command (zfctl.app)."""

from zfctl.app import main

main()
