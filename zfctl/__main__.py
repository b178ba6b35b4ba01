from zfctl.app import main

main()
