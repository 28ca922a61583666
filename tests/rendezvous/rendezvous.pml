/* The fsm rendezvous protocol (fsm_agent/plugins/rendezvous_fsm/planner.py, run by the store
 * server in its one thread) as a Promela model for SPIN; tests/rendezvous/test_rendezvous_model.py
 * checks it.
 *
 * One process is the store: it takes one request at a time from `req` (join, leave, lose), so
 * every operation is atomic, as in the server; it may also complete a round with MIN <= n < MAX
 * at any moment once no other live node can join (the settle window passing: timing is
 * abstracted away, which only adds behaviours). N participant processes join, may crash at any step (the store then
 * gets `lose` from the lease, in order with their other requests: the lease is owned by the
 * node's join connection), leave after being ranked, or
 * join again (workers failed, or a membership change was signalled: a participant lost, a
 * round opened by another node, nodes waiting for a round with room; the store tells each
 * watcher once per change of "some lost / some waiting", which the nondeterministic rejoin covers).
 *
 * Checked (assertions and end states):
 *   - no two participants of one round get one rank;
 *   - a round completes at most once;
 *   - no deadlock: the store and the idle ranked participants are the only valid end states;
 *   - every live participant is ranked when MIN live nodes are there: when nothing else can
 *     happen (SPIN's `timeout`), a node still waiting for its rank means fewer than MIN live nodes.
 *
 * -DBROKEN removes the planner's rule that nodes waiting at a complete round whose participants
 * are all gone open the next round themselves (the deadlock the property test found): the check
 * must fail on it.
 */

#ifndef N
#define N 3
#endif
#ifndef MIN
#define MIN 2
#endif
#ifndef MAX
#define MAX 2
#endif
#define CRASHES 2
#define RESTARTS 1
#define NONE 255

mtype = { JOIN, LEAVE, LOSE, RANKED, NOTNEEDED };

chan req = [2 * N] of { mtype, byte, byte };   /* op, node, the round its last join returned */
chan ans[N] = [1] of { mtype, byte, byte };    /* status, round, rank */

/* the store's state: planner.Rendezvous */
byte round = 0;
bool complete = false;
bool node[N];       /* live nodes of the run */
bool part[N];       /* this round's participants */
bool lost[N];       /* participants of the complete round that are gone */
bool reserved[N];   /* live participants of the last round, not joined yet: seats kept for them */
bool waiting[N];    /* wait list */
bool blocked[N];    /* a join of this node awaits its answer */
byte seq[N];        /* first-join order: ranks are stable */
byte nextseq = 0;
byte rank[N];
byte completed[16]; /* how often each round completed */

/* what the participants saw */
bool alive[N];
bool got[N];
byte got_round[N];
byte got_rank[N];
byte crashes = 0;
byte restarts = 0;

byte nparts, nlive, nreserved, nnodes, nwaiting;

inline count() {
    nparts = 0; nlive = 0; nreserved = 0; nnodes = 0; nwaiting = 0;
    j = 0;
    do
    :: j < N ->
        if :: part[j] -> nparts++ :: else fi;
        if :: part[j] && !lost[j] -> nlive++ :: else fi;
        if :: reserved[j] -> nreserved++ :: else fi;
        if :: node[j] -> nnodes++ :: else fi;
        if :: waiting[j] -> nwaiting++ :: else fi;
        j++
    :: else -> break
    od
}

inline seat(x) {
    part[x] = true; reserved[x] = false; waiting[x] = false
}

/* seat waiting nodes while the incomplete round has seats beyond the reserved ones */
inline admit() {
    if
    :: !complete ->
        a = 0;
        do
        :: a < N ->
            count();
            if :: waiting[a] && MAX - nparts - nreserved > 0 -> seat(a) :: else fi;
            a++
        :: else -> break
        od
    :: else
    fi
}

inline open_round(me) {
    j = 0;
    do
    :: j < N -> reserved[j] = part[j] && !lost[j] && j != me; part[j] = false; lost[j] = false; j++
    :: else -> break
    od;
    round++;
    complete = false;
    if :: me != NONE -> seat(me) :: else fi;
    admit()
}

inline complete_round() {
    assert(completed[round] == 0);  /* a round completes at most once */
    completed[round]++;
    j = 0;
    do
    :: j < N ->
        if
        :: part[j] ->
            k = 0; r = 0;
            do
            :: k < N -> if :: part[k] && seq[k] < seq[j] -> r++ :: else fi; k++
            :: else -> break
            od;
            rank[j] = r
        :: else
        fi;
        j++
    :: else -> break
    od;
    complete = true;
    count();
    j = 0;
    do
    :: j < N ->
        reserved[j] = false;
        if :: part[j] -> waiting[j] = false :: else fi;
        if :: part[j] && blocked[j] -> blocked[j] = false; ans[j]!RANKED,round,rank[j] :: else fi;
        if  /* the round is full: the nodes still waiting are not needed */
        :: nparts >= MAX && waiting[j] ->
            waiting[j] = false; node[j] = false;
            if :: blocked[j] -> blocked[j] = false; ans[j]!NOTNEEDED,round,0 :: else fi
        :: else
        fi;
        j++
    :: else -> break
    od
}

/* after every operation: a round with MAX participants completes at once */
inline tick() {
    count();
    if :: !complete && nparts >= MAX -> complete_round() :: else fi
}

inline forget(x) {
    waiting[x] = false; reserved[x] = false; blocked[x] = false;
    if
    :: complete -> if :: part[x] -> lost[x] = true :: else fi
    :: else -> part[x] = false
    fi;
    node[x] = false;
    count();
#ifndef BROKEN
    if :: complete && nwaiting > 0 && nlive == 0 -> open_round(NONE) :: else fi;
#endif
    admit()
}

active proctype Store() {
    mtype op; byte who, returned, a, j, k, r;
end:
    do
    :: req?op,who,returned ->
        atomic {
            if
            :: op == JOIN ->
                if :: !node[who] -> node[who] = true; seq[who] = nextseq; nextseq++ :: else fi;
                count();
                if
                :: complete && part[who] && !lost[who] ->
                    if
                    :: round != returned -> ans[who]!RANKED,round,rank[who]
                    :: else -> blocked[who] = true; open_round(who)  /* it asks for a new round */
                    fi
                :: complete && !(part[who] && !lost[who]) ->
                    if
                    :: nlive >= MAX -> node[who] = false; ans[who]!NOTNEEDED,round,0
                    :: else ->
                        waiting[who] = true; blocked[who] = true;
#ifndef BROKEN
                        if :: nlive == 0 -> open_round(NONE) :: else fi
#endif
                    fi
                :: !complete && part[who] -> blocked[who] = true
                :: !complete && !part[who] ->
                    blocked[who] = true;
                    if
                    :: MAX - nparts - (reserved[who] -> 0 : nreserved) > 0 -> seat(who)
                    :: else -> waiting[who] = true
                    fi
                fi
            :: op == LEAVE || op == LOSE -> forget(who)
            fi;
            tick()
        }
    /* the settle window passed with no other live node left to join (the counts are those after
     * the last operation). rejoin_timeout, which completes a round without live nodes that do not
     * come, is left out: the model assumes live nodes come within it (else a node slower than
     * rejoin_timeout every time could miss every round). */
    :: atomic { !complete && nparts >= MIN && nparts < MAX && nnodes == nparts -> complete_round() }
    od
}

/* a membership change this ranked participant is told about (membership_fd readable) */
#define SIGNALLED(i) (round != got_round[i] || (complete && (lost[0] || lost[1] || lost[2] LOST3)) || \
                      (complete && (waiting[0] || waiting[1] || waiting[2] WAIT3) && nlive < MAX))
#if N > 3
#define LOST3 || lost[3]
#define WAIT3 || waiting[3]
#else
#define LOST3
#define WAIT3
#endif

proctype Participant(byte i) {
    mtype st; byte r, k, j, live;
    byte returned = NONE;
    alive[i] = true;
join:
    req!JOIN,i,returned;
    do
    :: ans[i]?st,r,k ->
        if
        :: st == RANKED ->
            atomic {
                j = 0;
                do  /* no two participants of one round share a rank */
                :: j < N -> assert(j == i || !got[j] || got_round[j] != r || got_rank[j] != k); j++
                :: else -> break
                od;
                got[i] = true; got_round[i] = r; got_rank[i] = k; returned = r
            };
            goto ranked
        :: st == NOTNEEDED -> goto gone
        fi
    :: atomic { crashes < CRASHES -> crashes++ }; goto crash
    :: timeout ->  /* nothing else can happen while this node waits for its rank */
        atomic {
            live = 0; j = 0;
            do
            :: j < N -> if :: alive[j] -> live++ :: else fi; j++
            :: else -> break
            od;
            assert(live < MIN)  /* every live participant is ranked when MIN live nodes are there */
        };
        req!LEAVE,i,0;  /* its join timed out: the agent shuts the handler down */
        goto gone
    od;
ranked:
end_idle:
    do
    :: SIGNALLED(i) -> goto join
    :: atomic { restarts < RESTARTS -> restarts++ }; goto join  /* its workers failed */
    :: atomic { crashes < CRASHES -> crashes++ }; goto crash
    :: req!LEAVE,i,0; goto gone
    od;
crash:
    alive[i] = false;
    req!LOSE,i,0;  /* its lease ends with its connection */
gone:
    alive[i] = false
}

init {
    byte i = 0;
    atomic {
        do
        :: i < N -> run Participant(i); i++
        :: else -> break
        od
    }
}
