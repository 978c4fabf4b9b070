from .cli.process import main

main()
