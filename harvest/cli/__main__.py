from harvest.cli import main

main()
