from fsm_agent.cli import main

main()
