from rv.cli.main import main

main()
