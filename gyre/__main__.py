from gyre.cli import main

main()
