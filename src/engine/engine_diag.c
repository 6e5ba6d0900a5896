/* engine_diag.c - diagnostics around an engine step (off unless asked for).
 *
 *   LETHE_STEP_TIMES=1   host seconds of every pure decode step (no prefill
 *                        token), split at the hooks below:
 *                          begin --[forward call]--> forward_done
 *                                --[sample + finish_step]--> end
 *                        plus plan_layer's share of the forward call
 *                        (engine_forward.c adds it while `timed`) and the
 *                        graph launch + device wait inside it (graph steps:
 *                        model/forward_uniform.c times graph_launch /
 *                        graph_end); logged as ms per step, with the
 *                        method's name and the slowest step (a method's
 *                        compaction, a graph capture), when the engine is destroyed. Host
 *                        issue time = the forward call minus the graph
 *                        launch + wait: what the host spends planning,
 *                        staging and launching (on an eager step, every op
 *                        launch and any host round trip inside the step).
 *                        The device runs behind the host: the graph wait
 *                        and the sampling call (which waits for the device)
 *                        hold the device time, so host share = host issue /
 *                        whole step says whether the host is hidden.
 *   LETHE_PROFILE_STEP=N the device profiler's range (ops->profile_range)
 *                        around the N-th pure decode step (1-based), for
 *                        `ncu --profile-from-start off` over one real step.
 *
 * Both are read once at create through the env table (core/env.h). */
#include "core/env.h"
#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"

lethe_status eng_diag_init(lethe_engine *e) {
    lethe_status st = lethe_env_bool(LETHE_ENV_STEP_TIMES, &e->diag.step_times);
    if (st == LETHE_OK) st = lethe_env_uint(LETHE_ENV_PROFILE_STEP, &e->diag.profile_step);
    if (st != LETHE_OK) return st;
    if (!e->runner.be || !lethe_backend_has(e->runner.be, LETHE_BE_PROFILER))
        e->diag.profile_step = 0; /* no device profiler */
    return LETHE_OK;
}

void eng_diag_step_begin(lethe_engine *e, bool pure_decode) {
    eng_diag *d = &e->diag;
    if (pure_decode) d->n_decode_steps++;
    d->profiled = pure_decode && d->profile_step > 0 && d->n_decode_steps == d->profile_step;
    if (d->profiled) e->runner.be->ops->profile_range(e->runner.be, true);
    d->timed = d->step_times && pure_decode;
    if (d->timed) {
        d->t_graph0 = e->fwd.gs->t_graph;
        d->graphs0 = e->fwd.gs->n_replays + e->fwd.gs->n_captures;
        d->t0 = lethe_time_s();
    }
}

void eng_diag_forward_done(lethe_engine *e) {
    if (e->diag.timed) e->diag.t1 = lethe_time_s();
}

void eng_diag_step_end(lethe_engine *e) {
    eng_diag *d = &e->diag;
    if (d->profiled) e->runner.be->ops->profile_range(e->runner.be, false);
    d->profiled = false;
    if (!d->timed) return;
    const double t2 = lethe_time_s();
    d->n_timed++;
    d->t_fwd += d->t1 - d->t0;
    d->t_sample += t2 - d->t1;
    d->t_step += t2 - d->t0;
    if (t2 - d->t0 > d->t_step_max) d->t_step_max = t2 - d->t0;
    d->t_graph += e->fwd.gs->t_graph - d->t_graph0;
    d->n_graph_steps += e->fwd.gs->n_replays + e->fwd.gs->n_captures != d->graphs0;
    d->timed = false;
}

void eng_diag_report(const lethe_engine *e) {
    const eng_diag *d = &e->diag;
    if (!d->step_times || d->n_timed == 0) return;
    const double k = 1e3 / (double)d->n_timed;
    const double host = d->t_fwd - d->t_graph;
    LOG_INFO("step times (LETHE_STEP_TIMES, method %s, %lld decode steps, %lld of them graphs, host ms "
             "per step): step %.3f = host issue %.3f (plan_layer %.3f) + graph launch/wait %.3f + "
             "sample/wait %.3f; host share %.1f%%; slowest step %.3f",
             e->method->ops->name, (long long)d->n_timed, (long long)d->n_graph_steps, d->t_step * k,
             host * k, d->t_plan * k, d->t_graph * k, d->t_sample * k,
             d->t_step > 0 ? 100.0 * host / d->t_step : 0.0, d->t_step_max * 1e3);
}
