/* The tensor-core backward's team functions: dQ (gpu_dq_teams.h) and
 * dK/dV (gpu_dkv_teams.h), launched by gpu_tc_bwd_launch.c. */
#ifndef FORKATTN_GPU_BWD_TEAMS_H
#define FORKATTN_GPU_BWD_TEAMS_H
#include "gpu_dkv_teams.h"
#include "gpu_dq_teams.h"
#endif
